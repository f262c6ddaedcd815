"""One full ring3 Co-RL step on one GPU (shared placement), with its time split, before and after the length work.

Three agents at real shapes with random weights (Qwen2.5-1.5B, Llama-3.2-1B, Qwen3-0.6B; fp32 master weights, bf16
compute), 16 prompts x G=8 completions of up to `--max-new` tokens each, answers + votes + rewards on the host, then
one GRPO update per agent. Random weights never stop, so every row is forced (`Sampler.generate(forced_lengths=...)`)
to end at a length drawn from `length_model.py`'s LogNormal (mean 45% of the budget, 10% truncated; the same draws
for every variant and step; `--lengths full` forces every row to the budget instead).

Variants (`--variants`, `length_bucket/decode_compaction` pairs; `p64/2`: `grpo.packing` with length_bucket 64) run in
one process on the same lengths and prompts;
a variant's first appearance of a setting compiles in an untimed warm-up step (the others reuse those programs), then
one step is timed. Per timed step: real completion tokens, decode steps and row-steps (the rows the decode loop ran,
finished ones included), sampling / answers + vote / update seconds, the update's padded-FLOPs fraction. The JSON is
rewritten after every step.

    python experiments/bench/bench_cohort.py --out experiments/results/bench_cohort_lengths.json
    python experiments/bench/bench_cohort.py --tiny --max-new 32 --prompts 2 --out /tmp/bench_cohort.json  # CPU check
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from corl_jax.cohort import Cohort, make_agent
from corl_jax.config import agent_config, base_config
from corl_jax.data import PromptBlock
from corl_jax.demo import arithmetic
from corl_jax.demo.checkpoints import CHAT_STYLE
from corl_jax.demo.tokenizers import build_tokenizer
from corl_jax.models import Decoder, ModelConfig, Policy
from corl_jax.models.config import REMAT_POLICIES, TRAIN_ATTENTION_IMPLS
from corl_jax.sampling.engine import DECODE_ATTENTION_IMPLS
from corl_jax.tokenization import load_tokenizer
from length_model import lognormal_params, sample_lengths
from shapes import SHAPES

MEAN, TRUNCATED = 0.45, 0.10  # length model: mean fraction of the budget, fraction truncated


def forced_lengths(budget: int, rows: int, seed: int, full: bool) -> np.ndarray:
    """Per-row completion lengths of one agent; rows drawn at the budget are truncated (forced past it)."""
    if full:
        return np.full(rows, budget + 1)
    lengths = sample_lengths(*lognormal_params(MEAN, TRUNCATED), budget, rows, seed)
    return np.where(lengths >= budget, budget + 1, lengths)


def decode_work(lengths: np.ndarray, stages: tuple[int, ...]) -> tuple[int, int]:
    """(decode steps, row-steps) the sampler's loop runs for rows of these lengths: at step t the rows with
    length > t are live, and the batch is the smallest stage the live rows have not yet fitted into."""
    stage, row_steps = 0, 0
    for t in range(1, int(lengths.max())):
        live = int((lengths > t).sum())
        while stage + 1 < len(stages) and live <= stages[stage + 1]:
            stage += 1
        row_steps += stages[stage]
    return int(lengths.max()) - 1, row_steps


class CompileCounter(logging.Handler):
    """Counts XLA compilations (jax_log_compiles messages)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Compiling")


def variant(text: str) -> tuple[str, int, int, bool]:
    """`[p]bucket/compaction` -> (its name, length_bucket, decode_compaction, packing)."""
    bucket, _, compaction = text.partition("/")
    return text, int(bucket.removeprefix("p")), int(compaction), bucket.startswith("p")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/bench_cohort_lengths.json")
    parser.add_argument("--max-new", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--remat", default="dots_no_batch", choices=REMAT_POLICIES)
    parser.add_argument("--attention", default="auto", choices=TRAIN_ATTENTION_IMPLS)
    parser.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION_IMPLS,
                        help="rollout.decode_attention")
    parser.add_argument("--shapes", type=lambda v: v.split(","),
                        default=["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"])
    parser.add_argument("--tiny", action="store_true", help="the 'tiny' shape for every family (CPU check)")
    parser.add_argument("--lengths", default="lognormal", choices=("lognormal", "full"))
    parser.add_argument("--variants", type=lambda v: [variant(x) for x in v.split(",")],
                        default=[variant(x) for x in ("0/0", "128/2", "128/0", "0/2")],
                        help="length_bucket/decode_compaction pairs (p64/2: packing, width rounding 64), in order "
                             "(the first is 'before')")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = base_config()
    rows = args.prompts * args.generations
    config.rollout.update(prompts_per_step=args.prompts, num_generations=args.generations,
                          max_new_tokens=args.max_new, max_prompt_len=512)
    config.grpo.update(micro_batch_size=args.micro_batch, remat=args.remat, attention=args.attention)
    config.rollout.decode_attention = args.decode_attention
    workdir = Path(tempfile.mkdtemp())
    agents, lengths = [], {}
    for index, shape in enumerate(args.shapes):
        family, hf = SHAPES[shape]
        if args.tiny:
            hf = SHAPES["tiny"][1]
        name = family  # an agent per family; ConfigDict keys cannot hold the dots of the shape names
        if name in config.agents:
            parser.error(f"--shapes: two shapes of the {family} family; give one shape per family")
        config.agents[name] = agent_config(f"random:{shape}", family)
        build_tokenizer(workdir / name, "char", style=CHAT_STYLE[family])
        tokenizer = load_tokenizer(workdir / name)
        model_config = ModelConfig.from_hf_dict({"model_type": family, **hf}, param_dtype=jnp.float32,
                                                dtype=jnp.bfloat16, remat=args.remat, attention=args.attention)
        policy = Policy(config=model_config, model=Decoder(model_config, rngs=nnx.Rngs(index)), tokenizer=tokenizer)
        agent = make_agent(config, name, index, policy, (tokenizer.eos_token_id,), total_steps=100)
        # committed to the device like the update's outputs, so the second step reuses the first step's programs
        agent.params, agent.opt_state = jax.device_put((agent.params, agent.opt_state), jax.devices()[0])
        lengths[name] = forced_lengths(args.max_new, rows, args.seed + index, args.lengths == "full")
        agent.sampler.generate = functools.partial(agent.sampler.generate, forced_lengths=lengths[name])
        agents.append(agent)
    cohort = Cohort(config, agents)
    problems = tuple(arithmetic.generate("rl", args.prompts))  # the same block every step: same prompts, programs
    all_lengths = np.concatenate([np.minimum(x, args.max_new) for x in lengths.values()])

    import flax
    import transformers

    payload = dict(command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind), placement="shared",
                   agents={SHAPES[s][0]: ("tiny" if args.tiny else s) for s in args.shapes}, prompts=args.prompts,
                   generations=args.generations, max_new_tokens=args.max_new, micro_batch=args.micro_batch,
                   remat=args.remat, attention=args.attention, decode_attention=args.decode_attention,
                   length_model=dict(kind=args.lengths, target_mean=MEAN, target_truncated=TRUNCATED,
                                     mu_sigma=[round(x, 4) for x in lognormal_params(MEAN, TRUNCATED)],
                                     seed=args.seed, real_tokens=int(all_lengths.sum()),
                                     mean_fraction=round(float(all_lengths.mean() / args.max_new), 4),
                                     truncated=round(float(np.mean(np.concatenate(list(lengths.values()))
                                                                   > args.max_new)), 4)),
                   versions=dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
                                 transformers=transformers.__version__),
                   steps=[])
    counter = CompileCounter()
    logging.getLogger("jax._src.interpreters.pxla").addHandler(counter)
    logging.getLogger("jax._src.interpreters.pxla").propagate = False
    jax.config.update("jax_log_compiles", True)
    seen_buckets, seen_compactions, step = set(), set(), 0
    for name, bucket, compaction, packing in args.variants:
        config.grpo.update(length_bucket=bucket, packing=packing)
        for agent in agents:
            agent.sampler.compaction = compaction
        compiled = (bucket, packing) in seen_buckets and compaction in seen_compactions
        seen_buckets.add((bucket, packing))
        seen_compactions.add(compaction)
        for timed in ((True,) if compiled else (False, True)):
            step += 1
            # Cohort step 1 every time: the same sampling keys and row shuffle, so the same update plan (programs)
            block = PromptBlock(step=1, epoch=0, problems=problems)
            compiles, t0 = counter.count, time.perf_counter()
            metrics, _ = cohort.step(block, 1)
            wall = time.perf_counter() - t0
            first = metrics[next(iter(metrics))]
            work = [decode_work(np.minimum(lengths[a.name], args.max_new), a.sampler.stages(rows)) for a in agents]
            record = dict(
                step=step, variant=name, length_bucket=bucket, packing=packing, decode_compaction=compaction,
                timed=timed,
                compiles=counter.count - compiles, wall_s=round(wall, 2),
                sampling_s=round(first["time/sampling"], 2),
                answers_vote_s=round(first.get("time/answers", 0.0) + first.get("time/vote", 0.0), 3),
                update_s=round(first["time/update"], 2),
                real_tokens=int(sum(m["completions/mean_length"] for m in metrics.values()) * rows),
                decode_steps=[w[0] for w in work], decode_row_steps=sum(w[1] for w in work),
                padded_flops_fraction={n: round(m["update/padded_flops_fraction"], 4) for n, m in metrics.items()})
            record["padded_decode_tokens"] = record["decode_row_steps"] + len(agents) * rows - record["real_tokens"]
            record["host_fraction"] = round(record["answers_vote_s"] / wall, 4)
            payload["steps"].append(record)
            print(json.dumps(record), flush=True)
            timed_steps = [s for s in payload["steps"] if s["timed"]]
            payload["speedup_vs_first"] = {s["variant"]: dict(
                wall=round(timed_steps[0]["wall_s"] / s["wall_s"], 3),
                sampling=round(timed_steps[0]["sampling_s"] / s["sampling_s"], 3),
                update=round(timed_steps[0]["update_s"] / s["update_s"], 3)) for s in timed_steps}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
