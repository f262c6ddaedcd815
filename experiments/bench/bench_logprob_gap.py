"""How far the sampler's log-probs are from the trainer's on the same tokens (what the IS correction corrects).

Random weights at a real shape (experiments/bench/shapes.py), the training precision (fp32 master weights, bf16 compute):
sample completions with our sampler (its fused decode path: KV cache, decode attention kernel on GPUs), score the
same tokens with the trainer's forward (`corl_jax.cohort.score_completions`), and report per-token |difference|
(mean, p50, p99, max) over the completion tokens plus the truncated IS weight min(exp(trainer - sampler), 3)
(`corl_jax.grpo.sampling_correction`: min / mean / max), as TRL logs them. Saves JSON under experiments/results/.

    python experiments/bench/bench_logprob_gap.py                  # Qwen2.5-1.5B shape, 16 prompts x 8, 256 + 512 tokens
    python experiments/bench/bench_logprob_gap.py --tiny           # a CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from corl_jax import grpo
from corl_jax.cohort import UpdateSettings, score_completions
from corl_jax.models import Decoder, ModelConfig
from corl_jax.sampling import Sampler, SamplingParams
from shapes import SHAPES


def measure(args) -> dict:
    family, hf = SHAPES[args.shape]
    config = ModelConfig.from_hf_dict({"model_type": family, **hf}, param_dtype=jnp.dtype(args.param_dtype),
                                      dtype=jnp.bfloat16, attention=args.attention)
    model = Decoder(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    ids = rng.integers(100, min(1000, config.vocab_size), (args.prompts, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    sampler = Sampler(model, stop_ids=(), attention=args.decode_attention)
    t0 = time.perf_counter()
    out = sampler.generate(ids, mask, num_samples=args.samples, max_new_tokens=args.new_tokens,
                           params=SamplingParams(temperature=args.temperature), key=jax.random.key(0))
    jax.block_until_ready(out)
    sample_s = time.perf_counter() - t0
    rows = args.prompts * args.samples
    tokens = jnp.concatenate([jnp.asarray(np.repeat(ids, args.samples, 0)), out.tokens], axis=1)
    attention = jnp.concatenate([jnp.asarray(np.repeat(mask, args.samples, 0)), out.mask], axis=1)
    settings = UpdateSettings(loss_type="bnpo", eps_low=0.2, eps_high=0.2, beta=0.0, num_micro=rows // args.micro_batch,
                              chunk_size=128, temperature=args.temperature)
    graphdef, params = nnx.split(model)
    trainer_logp = score_completions(graphdef, params, tokens, attention, args.prompt_len, settings)[0]
    ratio, is_metrics = grpo.sampling_correction(trainer_logp, out.logprobs, out.mask, cap=3.0)
    live = np.asarray(out.mask)
    gap = np.abs(np.asarray(trainer_logp) - np.asarray(out.logprobs))[live]
    return dict(
        tokens=int(live.sum()), sample_s=round(sample_s, 2),
        abs_logp_diff=dict(mean=float(gap.mean()), p50=float(np.percentile(gap, 50)),
                           p99=float(np.percentile(gap, 99)), max=float(gap.max())),
        mean_sampler_logp=float(np.asarray(out.logprobs)[live].mean()),
        **{k: float(v) for k, v in is_metrics.items()},
        capped_fraction=float((np.asarray(ratio)[live] >= 3.0).mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per trainer forward")
    parser.add_argument("--param-dtype", default="float32", help="master weights (training default: float32)")
    parser.add_argument("--attention", default="auto", help="trainer attention (grpo.attention)")
    parser.add_argument("--decode-attention", default="auto", help="sampler attention (rollout.decode_attention)")
    parser.add_argument("--tiny", action="store_true", help="tiny shape and sizes, for a CPU check")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.prompts, args.samples, args.prompt_len, args.new_tokens, args.micro_batch = \
            "tiny", 2, 4, 16, 32, 4
    figures = measure(args)
    import flax

    payload = dict(command=" ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
                   device=str(jax.devices()[0].device_kind),
                   versions=dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__),
                   settings={k: v for k, v in vars(args).items() if k != "out"}, figures=figures)
    out = Path(args.out or f"experiments/results/logprob_gap_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
