"""Issue 22 part 1, step 1: the real SmolLM2-135M-Instruct's base accuracy on candidate worlds (CPU is enough).

    python experiments/evidence/smollm2_base.py --out experiments/results/smollm2/base_accuracy.json \
        [--num 32] [--samples 4] [--max-new-tokens 192] [--sources SPEC ...]

Per data source: greedy accuracy, the mean accuracy of `--samples` completions per problem at T=1 (the rollout's
temperature), the majority-vote accuracy of those samples, and the EOS rate and mean length of the T=1 completions.
The JSON is rewritten after every source.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

MATH500 = "math500"  # the MATH-500 copy in the repository (corl_jax/assets/, `corl_jax.data.MATH500_PATH`)
SOURCES = ("arithmetic:test?levels=2&word_fraction=1&max_value=20",
           "arithmetic:test?levels=2&word_fraction=0&max_value=20",
           "arithmetic:test?levels=3&word_fraction=1&max_value=20",
           "arithmetic:test?levels=2,3&word_fraction=0&max_value=60",
           MATH500)


def measure(directory, problems, *, samples: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Greedy, T=1 mean-of-samples and T=1 majority-vote accuracy of the checkpoint at `directory`."""
    import jax

    from corl_jax.answers.math import extract_answer, grade_answer
    from corl_jax.benchmarks import gsm8k_number
    from corl_jax.demo.bases import majority_correct
    from corl_jax.models import from_pretrained
    from corl_jax.sampling import Sampler, SamplingParams
    from corl_jax.sampling.text import generate_texts
    from corl_jax.tokenization import stop_token_ids

    policy = from_pretrained(directory, dtype=jax.numpy.float32)
    sampler = Sampler.from_policy(policy, stop_ids=stop_token_ids(policy.tokenizer, directory))
    texts = [p.text for p in problems]
    greedy, _ = generate_texts(sampler, policy.tokenizer, texts, num_samples=1, max_new_tokens=max_new_tokens,
                               params=SamplingParams(greedy=True), key=jax.random.key(seed))
    sampled, completions = generate_texts(sampler, policy.tokenizer, texts, num_samples=samples,
                                          max_new_tokens=max_new_tokens, params=SamplingParams(temperature=1.0),
                                          key=jax.random.key(seed + 1))
    grade = lambda text, p: grade_answer(extract_answer(text), p.answer)  # noqa: E731
    lengths = np.asarray(completions.mask).sum(axis=1)
    t1 = [(t, p) for row, p in zip(sampled, problems) for t in row]
    share = lambda values: round(float(np.mean(values)), 4)  # noqa: E731
    return dict(greedy=share([grade(row[0], p) for row, p in zip(greedy, problems)]),
                t1_mean=share([grade(t, p) for t, p in t1]),
                t1_majority=round(float(majority_correct(sampled, problems).mean()), 4),
                t1_eos_rate=round(float((lengths < max_new_tokens).mean()), 4),
                t1_mean_length=round(float(lengths.mean()), 1),
                # diagnostics, not rewards: how often an answer is boxed (what the verifier reads), and how often
                # the text's last number is the answer whatever its format (lm-eval's GSM8K flexible-extract)
                greedy_boxed=share(["\\boxed" in row[0] for row in greedy]),
                greedy_last_number=share([gsm8k_number(row[0]) == p.answer for row, p in zip(greedy, problems)]),
                t1_boxed=share(["\\boxed" in t for t, _ in t1]),
                t1_last_number=share([gsm8k_number(t) == p.answer for t, p in t1]),
                example_greedy=greedy[0][0][:600])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/smollm2/base_accuracy.json")
    parser.add_argument("--sources", nargs="+", default=list(SOURCES))
    parser.add_argument("--num", type=int, default=32, help="problems per source (the first N)")
    parser.add_argument("--samples", type=int, default=4, help="T=1 completions per problem")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--model", default="", help="checkpoint directory (default: corl_jax.models.smollm2)")
    args = parser.parse_args()
    import jax

    from corl_jax.data import load_problems
    from corl_jax.models import smollm2

    directory = args.model or str(smollm2.smollm2_hf_dir())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(model=directory, device=str(jax.devices()[0]), num=args.num, samples=args.samples,
                   max_new_tokens=args.max_new_tokens, sources={})
    for spec in args.sources:
        start = time.time()
        problems = load_problems(spec)[:args.num]
        payload["sources"][spec] = dict(measure(directory, problems, samples=args.samples,
                                                max_new_tokens=args.max_new_tokens), seconds=round(time.time() - start))
        out.write_text(json.dumps(payload, indent=1) + "\n")
        print(spec, {k: v for k, v in payload["sources"][spec].items() if k != "example_greedy"}, flush=True)


if __name__ == "__main__":
    main()
