"""How many update programs a run compiles when every step's lengths differ: the distinct micro-batch shapes that
`grpo.length_bucket` (`cohort.bucket_plan`) and `grpo.packing` (`packing.pack_plan`) produce over a run's steps.

`bench_cohort.py` repeats one step's lengths, so it compiles each setting's programs once; a real run meets new
shapes until it has seen them all. Each step here draws `--prompts` MATH-500 problems (their chat prompts' real
token counts, by a real tokenizer: SmolLM2-135M-Instruct's unless `--tokenizer`), G completions each with lengths
from `length_model.py`'s LogNormal (mean 45% of the budget, 10% truncated), pads the prompts as the trainer does
(`tokenization.left_pad`: the step's longest rounded up to 64), and plans the update's micro-batches. A program is
one shape key per agent: (prompt width, completion width) of a bucketed micro-batch (`_accumulate`, and
`score_completions` for the old log-probs), (line width, scored positions) of a packed one (`_accumulate_packed`,
`_score_packed`). The sampler's programs follow the prompt width alone (listed too). Also the mean share of the
update's FLOPs spent on padding at each of `--shapes` (`cohort.padded_flops_fraction`, `packing.packed_flops_fraction`: a
packed line's attention counts its whole square). Host only, no device.

    python experiments/bench/compile_churn.py --out experiments/results/compile_churn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from corl_jax.cohort import bucket_plan, padded_flops_fraction
from corl_jax.models import ModelConfig
from corl_jax.packing import pack_plan, packed_flops_fraction
from corl_jax.tokenization import bucket_length, load_tokenizer, prompt_lengths
from length_model import lognormal_params, sample_lengths
from shapes import SHAPES

REPO = Path(__file__).resolve().parents[2]


def step_plan(prompt_tokens: np.ndarray, lengths: np.ndarray, prompt_width: int, budget: int, micro: int,
              setting: str, model_configs: dict) -> tuple[set[tuple[int, int]], dict[str, float]]:
    """The update's micro-batch shape keys of one step under `setting` ("bucket:N" or "pack:N") and, per model
    shape of `model_configs`, the share of its FLOPs spent on padding."""
    kind, bucket = setting.split(":")
    bucket = int(bucket)
    if kind == "pack":
        plan = pack_plan(prompt_tokens, lengths, micro, prompt_width + budget, bucket)
        return (set(zip(plan.widths.tolist(), plan.heads.tolist())),
                {k: packed_flops_fraction(c, prompt_tokens, lengths, plan) for k, c in model_configs.items()})
    plan = bucket_plan(prompt_tokens, lengths, len(lengths) // micro, bucket, prompt_width, budget)
    return (set(zip(plan[1].tolist(), plan[2].tolist())),
            {k: padded_flops_fraction(c, prompt_tokens, lengths, plan) for k, c in model_configs.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/compile_churn.json")
    parser.add_argument("--tokenizer", default=None, help="an HF checkpoint directory (default: SmolLM2's)")
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/math500_test.json"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--micro", type=lambda v: [int(x) for x in v.split(",")], default=[2, 4, 16])
    parser.add_argument("--settings", type=lambda v: v.split(","),
                        default=["bucket:0", "bucket:128", "bucket:64", "pack:128", "pack:64"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--checkpoints", type=lambda v: [int(x) for x in v.split(",")],
                        default=[1, 10, 50, 100, 200, 500, 1000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", type=lambda v: v.split(","), default=["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"],
                        help="the model shapes of the padded-FLOPs fraction")
    args = parser.parse_args()

    if args.tokenizer is None:
        from corl_jax.models.smollm2 import smollm2_hf_dir
        args.tokenizer = str(smollm2_hf_dir())
    problems = [row["prompt"] for row in json.loads(Path(args.data).read_text())]
    tokens_of = np.asarray(prompt_lengths(load_tokenizer(args.tokenizer), problems))
    mu, sigma = lognormal_params(0.45, 0.10)
    rng = np.random.default_rng(args.seed)
    model_configs = {shape: ModelConfig.from_hf_dict({"model_type": SHAPES[shape][0], **SHAPES[shape][1]})
                     for shape in args.shapes}
    seen = {(s, m): set() for s in args.settings for m in args.micro}
    padded = {(s, m): [] for s in args.settings for m in args.micro}
    prompt_widths, curves = set(), {f"{s} micro {m}": [] for s in args.settings for m in args.micro}
    sampler_curve = []
    for step in range(1, args.steps + 1):
        chosen = tokens_of[rng.choice(len(problems), args.prompts, replace=False)]
        prompt_width = bucket_length(int(chosen.max()), 64)
        prompt_widths.add(prompt_width)
        prompt_tokens = np.repeat(chosen, args.generations)
        lengths = sample_lengths(mu, sigma, args.budget, len(prompt_tokens), args.seed * 100_003 + step)
        for (setting, micro), keys in seen.items():
            step_keys, fraction = step_plan(prompt_tokens, lengths, prompt_width, args.budget, micro, setting,
                                            model_configs)
            keys |= step_keys
            padded[setting, micro].append(fraction)
            if step in args.checkpoints:
                curves[f"{setting} micro {micro}"].append(len(keys))
        if step in args.checkpoints:
            sampler_curve.append(len(prompt_widths))
    payload = dict(
        command=" ".join(sys.argv), tokenizer=Path(args.tokenizer).name, data=Path(args.data).name,
        prompt_tokens=dict(min=int(tokens_of.min()), median=float(np.median(tokens_of)), max=int(tokens_of.max())),
        rows_per_step=args.prompts * args.generations, budget=args.budget,
        length_model=dict(mean_fraction=0.45, truncated=0.10, mu=round(mu, 4), sigma=round(sigma, 4)),
        after_steps=[c for c in args.checkpoints if c <= args.steps],
        update_programs=curves, sampler_prompt_widths=sampler_curve,
        padded_flops_fraction={f"{s} micro {m}": {shape: round(float(np.mean([f[shape] for f in v])), 4)
                                                  for shape in args.shapes} for (s, m), v in padded.items()},
        note="distinct update micro-batch shapes seen by each step (per agent; each shape compiles an accumulate "
             "program and a scoring program); sampler programs: distinct prompt widths")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
