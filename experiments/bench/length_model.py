"""The completion-length model of the cohort benchmarks and its padded-FLOPs fraction of the GRPO update, analytically.

Completion lengths are a LogNormal fraction of the budget, truncated at it: f = exp(mu + sigma z), z ~ N(0, 1),
length = ceil(min(f, 1) * budget). sigma and mu solve P(f > 1) = `--truncated` (mu = -sigma Phi^-1(1 - truncated))
and E[min(f, 1)] = `--mean`. For each `grpo.length_bucket` the step's rows (`--rows`, micro-batches of `--micro`)
go through `cohort.bucket_plan`, and `cohort.padded_flops_fraction` counts padding with `ModelConfig.train_flops`;
packed (`grpo.packing`: `packing.pack_plan` into lines of prompt + budget tokens, `--micro` lines per micro-batch)
likewise with `packing.packed_flops_fraction`. No device needed.

    python experiments/bench/length_model.py --out experiments/results/length_model.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import optimize, stats

from corl_jax.cohort import bucket_plan, padded_flops_fraction
from corl_jax.models import ModelConfig
from corl_jax.packing import pack_plan, packed_flops_fraction
from shapes import SHAPES


def lognormal_params(mean: float, truncated: float) -> tuple[float, float]:
    """(mu, sigma) of the LogNormal budget fraction with E[min(f, 1)] = mean and P(f > 1) = truncated."""
    z = stats.norm.ppf(1.0 - truncated)

    def clipped_mean(sigma):
        mu = -sigma * z
        # E[f; f <= 1] + P(f > 1)
        return math.exp(mu + sigma ** 2 / 2) * stats.norm.cdf((-mu - sigma ** 2) / sigma) + truncated

    sigma = optimize.brentq(lambda s: clipped_mean(s) - mean, 1e-3, 10.0)
    return -sigma * z, sigma


def sample_lengths(mu: float, sigma: float, budget: int, rows: int, seed: int) -> np.ndarray:
    f = np.exp(mu + sigma * np.random.default_rng(seed).standard_normal(rows))
    return np.maximum(np.ceil(np.minimum(f, 1.0) * budget), 1).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/length_model.json")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of every row (no prompt padding)")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--mean", type=float, default=0.45)
    parser.add_argument("--truncated", type=float, default=0.10)
    parser.add_argument("--buckets", type=lambda v: [int(x) for x in v.split(",")], default=[0, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=100, help="steps (seeds) averaged over")
    parser.add_argument("--shapes", type=lambda v: v.split(","), default=["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"])
    args = parser.parse_args()

    mu, sigma = lognormal_params(args.mean, args.truncated)
    prompt_tokens = np.full(args.rows, args.prompt)
    steps = [sample_lengths(mu, sigma, args.budget, args.rows, seed) for seed in range(args.steps)]
    bucketed, packed = {}, {}
    for shape in args.shapes:
        family, hf = SHAPES[shape]
        config = ModelConfig.from_hf_dict({"model_type": family, **hf})
        mean = lambda fractions: round(float(np.mean(fractions)), 4)  # noqa: E731
        bucketed[shape] = {str(b): mean([padded_flops_fraction(config, prompt_tokens, lengths, bucket_plan(
            prompt_tokens, lengths, args.rows // args.micro, b, args.prompt, args.budget)) for lengths in steps])
            for b in args.buckets}
        packed[shape] = {str(b): mean([packed_flops_fraction(config, prompt_tokens, lengths, pack_plan(
            prompt_tokens, lengths, args.micro, args.prompt + args.budget, b)) for lengths in steps])
            for b in args.buckets if b}
    lengths = np.concatenate(steps)
    payload = dict(command=" ".join(sys.argv), length_model=dict(
        distribution="ceil(min(exp(mu + sigma z), 1) * budget)", mu=round(mu, 4), sigma=round(sigma, 4),
        budget=args.budget, measured_mean_fraction=round(float(lengths.mean() / args.budget), 4),
        measured_truncated=round(float((lengths >= args.budget).mean()), 4),
        median_fraction=round(float(np.median(lengths) / args.budget), 4)),
        prompt=args.prompt, rows=args.rows, micro_batch=args.micro, steps=args.steps,
        padded_flops_fraction=bucketed, packed_padded_flops_fraction=packed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
