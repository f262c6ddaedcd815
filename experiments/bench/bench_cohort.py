"""One full ring3 Co-RL step on one GPU (shared placement), with its time split.

Three agents at real shapes with random weights (Qwen2.5-1.5B, Llama-3.2-1B, Qwen3-0.6B; fp32 master weights, bf16
compute), 16 prompts x G=8 completions of up to `--max-new` tokens each (random weights never stop early, so every
completion runs to the limit: the worst case), answers + votes + rewards on the host, then one GRPO update per agent.
The first step compiles; the second is timed.

    python experiments/bench/bench_cohort.py --out experiments/results/bench_cohort.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
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
from shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/bench_cohort.json")
    parser.add_argument("--max-new", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--remat", default="dots_no_batch", choices=REMAT_POLICIES)
    parser.add_argument("--attention", default="auto", choices=TRAIN_ATTENTION_IMPLS)
    parser.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION_IMPLS,
                        help="rollout.decode_attention")
    parser.add_argument("--shapes", type=lambda v: v.split(","),
                        default=["qwen2.5-1.5b", "llama3.2-1b", "qwen3-0.6b"])
    args = parser.parse_args()

    config = base_config()
    config.rollout.update(prompts_per_step=16, num_generations=8, max_new_tokens=args.max_new, max_prompt_len=512)
    config.grpo.update(micro_batch_size=args.micro_batch, remat=args.remat, attention=args.attention)
    config.rollout.decode_attention = args.decode_attention
    workdir = Path(tempfile.mkdtemp())
    agents = []
    for index, shape in enumerate(args.shapes):
        family, hf = SHAPES[shape]
        name = family  # an agent per family; ConfigDict keys cannot hold the dots of the shape names
        if name in config.agents:
            parser.error(f"--shapes: two shapes of the {family} family; give one shape per family")
        config.agents[name] = agent_config(f"random:{shape}", family)
        build_tokenizer(workdir / name, "char", style=CHAT_STYLE[family])
        tokenizer = load_tokenizer(workdir / name)
        model_config = ModelConfig.from_hf_dict({"model_type": family, **hf}, param_dtype=jnp.float32,
                                                dtype=jnp.bfloat16, remat=args.remat, attention=args.attention)
        policy = Policy(config=model_config, model=Decoder(model_config, rngs=nnx.Rngs(index)), tokenizer=tokenizer)
        agents.append(make_agent(config, name, index, policy, (tokenizer.eos_token_id,), total_steps=10))
    cohort = Cohort(config, agents)
    problems = tuple(arithmetic.generate("rl", 16))  # the same block twice: step 2 reuses step 1's programs
    steps = []
    for step in (1, 2):
        block = PromptBlock(step=step, epoch=0, problems=problems)
        t0 = time.perf_counter()
        metrics, _ = cohort.step(block, step)
        wall = time.perf_counter() - t0
        first = metrics[next(iter(metrics))]
        steps.append(dict(step=step, wall_s=round(wall, 2),
                          **{k: round(v, 2) for k, v in first.items() if k.startswith("time/")},
                          completion_tokens=int(sum(m["completions/mean_length"] for m in metrics.values()) * 128),
                          rewards={n: m["reward"] for n, m in metrics.items()}))
        print(json.dumps(steps[-1]), flush=True)
    timed = steps[-1]
    import flax
    import transformers

    payload = dict(command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind), placement="shared",
                   agents={SHAPES[s][0]: s for s in args.shapes}, prompts=16, generations=8,
                   max_new_tokens=args.max_new, micro_batch=args.micro_batch, remat=args.remat,
                   attention=args.attention, decode_attention=args.decode_attention,
                   versions=dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
                                 transformers=transformers.__version__),
                   steps=steps,
                   generated_tokens_per_s=round(timed["completion_tokens"] / timed["time/sampling"]),
                   split={k: round(timed[k] / timed["wall_s"], 3) for k in timed if k.startswith("time/")})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
