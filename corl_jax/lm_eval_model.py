"""lm-evaluation-harness backend: the model type `corl_jax` (our JAX sampler for `generate_until`, our forward for
`loglikelihood`).

    corl-lm-eval --model corl_jax --model_args path=OUT/<agent> --tasks gsm8k   # or workdir=DIR,agent=NAME,step=best
    python -m corl_jax.lm_eval_model ...                                       # the same

lm-eval 0.4.x resolves `--model` only against its own registry (it has no plugin discovery), so the plain `lm_eval`
command cannot see an external model type; `corl-lm-eval` imports this module (which registers `corl_jax`) and then
runs lm-eval's own command line with the arguments given. From Python: `import corl_jax.lm_eval_model` and then
`lm_eval.simple_evaluate(model="corl_jax", model_args=...)`.

model_args: path (an HF checkpoint directory) or workdir + agent [+ step: best|latest|N]; dtype (bfloat16),
batch_size (prompts per sampler call / sequences per forward, 16), max_length (4096), max_gen_toks (256),
add_bos_token (default: the tokenizer's own special tokens, as lm-eval's hf model), seed (0).
"""

from __future__ import annotations

import json
import sys

import lm_eval.models  # noqa: F401  (lm-eval's own model types, registered on import)
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from corl_jax import eval as corl_eval

_LENGTH_BUCKET = 64  # forward widths are rounded up to a multiple: few compiled programs


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("corl_jax")
class CorlJaxLM(TemplateLM):
    def __init__(self, path: str | None = None, workdir: str | None = None, agent: str | None = None,
                 step: str = "best", dtype: str = "bfloat16", batch_size: int | str = 16, max_length: int = 4096,
                 max_gen_toks: int = 256, add_bos_token: bool | str | None = None, seed: int = 0, **unused):
        super().__init__()
        if bool(path) == bool(workdir):
            raise ValueError("corl_jax model_args: give either path=HF_DIR or workdir=DIR,agent=NAME[,step=best]")
        if path:
            self.model = corl_eval.load_model(str(path), str(path), dtype=dtype)
        else:
            if not agent:
                raise ValueError("corl_jax model_args: workdir=DIR needs agent=NAME (and optionally step=best)")
            candidate = corl_eval.workdir_candidates(workdir, str(step), [agent])[0]
            self.model = candidate.agent
            from flax import nnx

            if candidate.params is not None:
                nnx.update(self.model.policy.model, candidate.params)
        self.tokenizer = self.model.policy.tokenizer
        self._batch = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self._max_length = min(int(max_length), self.model.policy.config.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self._add_bos = None if add_bos_token is None else _bool(add_bos_token)
        self._seed = int(seed)

    # --------------------------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Prefix of an empty context / rolling windows: the BOS when the tokenizer has one (as lm-eval's hf)."""
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """lm-eval's hf rule: the tokenizer's own special tokens (e.g. a BOS) unless told otherwise or the text
        already starts with the BOS."""
        special = _add_special_kwargs(add_special_tokens, self._add_bos)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # --------------------------------------------------------------------------------------------- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding would produce the continuation; the
        input is the last `max_length` tokens of context + continuation (minus its last token), as lm-eval's hf."""
        from corl_jax.models import logits as model_logits
        from corl_jax.tokenization import left_pad

        rows = []
        for _, context, continuation in requests:
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((tokens[:-1], continuation))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self._batch):
            chunk = order[start:start + self._batch]
            ids, mask = left_pad([rows[i][0] for i in chunk], self.tokenizer.pad_token_id, bucket=_LENGTH_BUCKET)
            scores = np.asarray(model_logits(self.model.policy, ids, mask), np.float32)
            for row, i in enumerate(chunk):
                continuation = np.asarray(rows[i][1])
                logits = scores[row, -len(continuation):]
                logp = logits - _logsumexp(logits)
                total = float(logp[np.arange(len(continuation)), continuation].sum())
                results[i] = (total, bool((logits.argmax(-1) == continuation).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood over disjoint windows of `max_length` tokens (lm-eval's hf scheme)."""
        out = []
        for (string,) in [r.args for r in requests]:
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            scored = self._loglikelihood_tokens([(None, context, continuation) for context, continuation in windows])
            out.append(sum(total for total, _ in scored))
        return out

    # --------------------------------------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Our sampler per group of equal generation settings; each text is cut at its first stop string."""
        import jax

        from corl_jax.sampling import SamplingParams

        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        for group_index, (settings, members) in enumerate(groups.items()):
            kwargs = dict(json.loads(settings))
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.pop("max_gen_toks", self._max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0))
            if _bool(kwargs.pop("do_sample", temperature > 0)) and temperature > 0:
                params = SamplingParams(temperature=temperature, top_p=float(kwargs.pop("top_p", 1.0)),
                                        top_k=int(kwargs.pop("top_k", 0) or 0))
            else:
                params = SamplingParams(greedy=True)
            # Contexts keep their last tokens so that the budget fits under max_length (lm-eval's hf does the same).
            keep = max(self.max_length - budget, 1)
            token_lists = [self.tok_encode(requests[i].args[0])[-keep:] for i in members]
            texts, _, _ = corl_eval.generate(self.model, token_lists, samples=1, max_new_tokens=budget, params=params,
                                          key=jax.random.fold_in(jax.random.key(self._seed), group_index),
                                          max_model_len=self.max_length, batch_prompts=self._batch)
            for i, (text,) in zip(members, texts):
                for stop in until:
                    if stop and stop in text:
                        text = text[:text.index(stop)]
                out[i] = text
        return out


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(-1, keepdims=True))


def main() -> None:
    """`lm_eval`'s command line with the `corl_jax` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "corl-lm-eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
