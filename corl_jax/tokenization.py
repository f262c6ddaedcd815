"""Tokenizers, prompts and stop ids: the text side of a policy, kept on the host.

Prompts are built as the Co-RL reference builds them (co_rl_reference.md §1.3, §3.1): one user
message ``f"{problem}\\n {INSTRUCTION}"`` rendered with the tokenizer's chat template and the
generation prompt, no system message added by us (a template may inject its own). Batches are
left-padded numpy arrays whose length is rounded up to a bucket, so jitted programs see a bounded
set of shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import transformers

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_prompt_text(problem: str) -> str:
    """The user message of the reference: the problem, a newline, a space, the instruction."""
    return f"{problem}\n {INSTRUCTION}"


def load_tokenizer(path: str | os.PathLike, *, chat_template: str | None = None):
    """Loads the fast tokenizer of a local checkpoint directory, left-padding, with a pad token.

    ``chat_template`` (Jinja text, or the path of a template file) replaces the tokenizer's own.
    The pad token falls back to the eos token, as the reference does (§2.3).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist; pass the local "
                                "directory of an HF checkpoint")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{directory} contains no tokenizer.json/tokenizer_config.json; "
                                "copy the tokenizer files of the model into it")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer in {directory} has neither a pad nor an eos token; "
                             "set eos_token in its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    return tokenizer


def _read_chat_template(value: str) -> str:
    """Jinja text is returned as is; anything else must name an existing template file."""
    if "{{" in value or "{%" in value:
        return value
    template_file = Path(value)
    if not template_file.is_file():
        raise FileNotFoundError(f"chat_template {value!r} is neither Jinja text (no '{{{{' or "
                                "'{%') nor an existing template file")
    return template_file.read_text()


def chat_prompt(tokenizer, problem: str, *, chat_template: str | None = None) -> str:
    """The prompt text for ``problem``: one user message through the chat template, with the
    generation prompt. ``chat_template`` (Jinja text) overrides the tokenizer's template."""
    return render_chat(tokenizer, build_prompt_text(problem), chat_template=chat_template)


def render_chat(tokenizer, message: str, *, chat_template: str | None = None) -> str:
    """One user turn ``message`` through the chat template (or ``chat_template``), with the generation prompt."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; set `chat_template` in its "
            "tokenizer_config.json (or add chat_template.jinja), or pass "
            "--config.agents.<name>.chat_template=<Jinja text or template file> (eval: --chat_template=False)")
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], chat_template=chat_template,
                                         tokenize=False, add_generation_prompt=True)


def bucket_length(length: int, bucket: int | Literal["pow2"]) -> int:
    """``length`` rounded up to the next power of two (``"pow2"``) or multiple of ``bucket``."""
    if bucket == "pow2":
        return 1 << max(length - 1, 0).bit_length()
    if not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"bucket must be 'pow2' or a positive int, got {bucket!r}")
    return -(-length // bucket) * bucket


def encode_prompts(tokenizer, problems: Sequence[str], *, max_prompt_len: int | None = None,
                   bucket: int | Literal["pow2"] = 64,
                   chat_template: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Chat prompts of ``problems`` as left-padded ``(ids int32 [P, Tb], mask bool [P, Tb])``.

    Tb is the longest prompt rounded up to ``bucket``, capped at ``max_prompt_len``. The text is
    encoded without added special tokens: the template already wrote them (no doubled BOS).
    """
    if len(problems) == 0:
        raise ValueError("encode_prompts got no problems")
    return left_pad(_prompt_tokens(tokenizer, problems, chat_template), tokenizer.pad_token_id,
                    max_prompt_len=max_prompt_len, bucket=bucket)


def left_pad(token_lists: Sequence[Sequence[int]], pad_id: int, *, max_prompt_len: int | None = None,
             bucket: int | Literal["pow2"] = 64) -> tuple[np.ndarray, np.ndarray]:
    """Token lists as a left-padded ``(ids int32 [P, Tb], mask bool [P, Tb])``, Tb the longest rounded up to
    ``bucket`` and capped at ``max_prompt_len`` (a longer prompt is an error)."""
    lengths = [len(t) for t in token_lists]
    longest = max(lengths)
    if max_prompt_len is not None and longest > max_prompt_len:
        too_long = [i for i, n in enumerate(lengths) if n > max_prompt_len]
        first = too_long[0]
        raise ValueError(
            f"prompt {first} has {lengths[first]} tokens, more than max_prompt_len={max_prompt_len} "
            f"({len(too_long)} of {len(token_lists)} prompts are too long, the longest has {longest}); "
            "raise max_prompt_len or filter those prompts out of the dataset")
    width = bucket_length(longest, bucket)
    if max_prompt_len is not None:
        width = min(width, max_prompt_len)
    ids = np.full((len(token_lists), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(token_lists), width), dtype=bool)
    for row, tokens in enumerate(token_lists):
        ids[row, width - len(tokens):] = tokens
        mask[row, width - len(tokens):] = True
    return ids, mask


def prompt_lengths(tokenizer, problems: Sequence[str], *, chat_template: str | None = None) -> list[int]:
    """The token count of each problem's chat prompt, as `encode_prompts` would encode it."""
    return [len(tokens) for tokens in _prompt_tokens(tokenizer, problems, chat_template)] if problems else []


def _prompt_tokens(tokenizer, problems: Sequence[str], chat_template: str | None) -> list[list[int]]:
    texts = [chat_prompt(tokenizer, p, chat_template=chat_template) for p in problems]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, checkpoint_dir: str | os.PathLike) -> tuple[int, ...]:
    """Sorted, de-duplicated ids that end a completion: the ``eos_token_id`` (int or list) of
    generation_config.json, or of config.json when there is none, plus the tokenizer's eos."""
    directory = Path(checkpoint_dir)
    ids = []
    for name in ("generation_config.json", "config.json"):
        config_file = directory / name
        if config_file.is_file():
            eos = json.loads(config_file.read_text()).get("eos_token_id")
            ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
            break
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"no stop token for {directory}: set eos_token_id in its "
                         "generation_config.json or eos_token in its tokenizer_config.json")
    vocab_size = len(tokenizer)
    bad = [i for i in ids if type(i) is not int or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"eos_token_id {bad} in {directory} is not a token id of its tokenizer "
                         f"(vocabulary of {vocab_size}); fix generation_config.json")
    return tuple(sorted(set(ids)))


def decode_completions(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Texts of completion rows ``ids [N, T]`` keeping the tokens where ``mask`` is true, with
    special tokens skipped as the reference decodes them (§1.3)."""
    ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
    if ids.shape != mask.shape or ids.ndim != 2:
        raise ValueError(f"ids {ids.shape} and mask {mask.shape} must be the same [N, T] shape")
    return tokenizer.batch_decode([row[keep].tolist() for row, keep in zip(ids, mask)],
                                  skip_special_tokens=True)
