"""The paper's ring3 shapes through the production entry points: `corl_jax.train` (2 steps, a checkpoint each), a
second `corl_jax.train` that resumes for `--resume-steps` more (default 1), then `corl_jax.eval` on the workdir.

The three agents are `random:<hub id>` stand-ins (corl_jax/stand_ins.py): Qwen2.5-3B, Llama-3.2-3B-Instruct and
Qwen3-1.7B-Base at their real shapes and vocabularies (8.3B parameters together), initialised in memory, with
byte-level tokenizers; no weights are read or written except the run's own checkpoints. Parameters are bfloat16
(`param_dtype=bfloat16`; optax keeps AdamW's moments in the parameter dtype, so they are bfloat16 too): fp32 master
weights + fp32 moments + fp32 gradients of 8.3B parameters are ~133 GB, more than one H200 holds. Each phase is a
subprocess; the JSON holds the commands, per-phase wall time, the per-step time split and device memory (read back
from metrics.jsonl: `time/*`, `memory/*`) and the eval's accuracy cells. Random weights: rewards are ~0; this is a
shape, memory and entry-point proof.

  python experiments/bench/paper_shape_run.py --workdir=/dev/shm/paper_shape --out=experiments/results/paper_shape_run.json
  python experiments/bench/paper_shape_run.py --size=tiny --workdir=/tmp/ps --out=/tmp/paper_shape_tiny.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAPER = {"qwen25": "Qwen/Qwen2.5-3B", "llama32": "meta-llama/Llama-3.2-3B-Instruct", "qwen3": "Qwen/Qwen3-1.7B-Base"}
# CPU-sized shapes of the same three families: one layer, small widths, a vocabulary above the tokenizer's 259 ids.
_TINY = "num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"
TINY_OPTIONS = {"qwen25": _TINY + ",vocab_size=1024", "llama32": _TINY + ",head_dim=16,vocab_size=1024",
                "qwen3": _TINY + ",head_dim=16,vocab_size=1024"}

# Settings that differ from the paper's (prompts_per_step 16 x 8 completions, 1024 new tokens, 1024 prompt tokens
# are kept at full size): the completion budget, and a short in-loop eval, so the three phases fit one device command.
SETTINGS = {
    "paper": dict(max_new_tokens=256, max_eval_samples=16, eval_max_new_tokens=64, eval_problems=8,
                  eval_new_tokens=32, prompts_per_step=16, micro_batch_size=8),
    "tiny": dict(max_new_tokens=8, max_eval_samples=4, eval_max_new_tokens=4, eval_problems=4, eval_new_tokens=4,
                 prompts_per_step=2, micro_batch_size=2),
}


def model_path(agent: str, size: str) -> str:
    return f"random:{PAPER[agent]}" + (f"@{TINY_OPTIONS[agent]}" if size == "tiny" else "")


def train_command(workdir: str, size: str, max_steps: int, prompts: int | None = None) -> list[str]:
    """The trainer's command; `prompts` replaces the size's prompts per step (e.g. to fit an 80 GB card)."""
    s = dict(SETTINGS[size], **({"prompts_per_step": prompts} if prompts else {}))
    agents = [arg for agent in PAPER for arg in (f"--config.agents.{agent}.model_path={model_path(agent, size)}",
                                                 f"--config.agents.{agent}.param_dtype=bfloat16")]
    sources = ["--config.data.train_path=math500", "--config.data.holdout_size=0", "--config.data.skip_bad_rows=True"]
    if size == "tiny":  # MATH-500 prompts do not fit a few-token CPU run; the update is the `:tiny` variant's
        # unpacked one (packing's line shapes compile 4x longer on 8 CPU devices; tests/test_multiprocess.py and
        # tests/test_update_oracle.py run the packed update)
        sources = ["--config.data.train_path=arithmetic", "--config.data.eval_path=arithmetic",
                   "--config.rollout.max_prompt_len=512", "--config.grpo.remat=none", "--config.grpo.packing=False",
                   "--config.grpo.length_bucket=128"]
    return [sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py", f"--workdir={workdir}", *agents,
            *sources, f"--config.rollout.prompts_per_step={s['prompts_per_step']}",
            f"--config.rollout.max_new_tokens={s['max_new_tokens']}",
            f"--config.grpo.micro_batch_size={s['micro_batch_size']}",
            f"--config.data.max_eval_samples={s['max_eval_samples']}", f"--config.train.max_steps={max_steps}",
            f"--config.train.save_every={max_steps}", "--config.train.keep_last=1", "--config.train.eval_on_start=False",
            "--config.train.eval_every=1000", f"--config.train.eval_max_new_tokens={s['eval_max_new_tokens']}",
            "--config.train.log_records=False"]


def eval_command(workdir: str, size: str) -> list[str]:
    s = SETTINGS[size]
    return [sys.executable, "-m", "corl_jax.eval", f"--workdir={workdir}", "--step=base,latest",
            "--benchmarks=arithmetic", f"--sampling.max_problems={s['eval_problems']}",
            f"--sampling.max_new_tokens={s['eval_new_tokens']}", f"--out={workdir}/eval"]


# bf16 parameters + two bf16 AdamW moments of the 8.3B parameters; a resumed run's new checkpoint is written before
# keep_last=1 deletes the old one, so the workdir briefly holds two. Each invocation saves its last step only.
CHECKPOINT_BYTES = {"paper": 8.3e9 * 2 * 3, "tiny": 0}


def run_phase(name: str, command: list[str], phases: dict) -> None:
    print(f"[{name}] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO)
    phases[name] = {"command": " ".join(command[1:]), "wall_s": round(time.perf_counter() - start, 2),
                    "returncode": done.returncode}
    if done.returncode:
        raise SystemExit(f"phase {name} failed with exit status {done.returncode} (command above)")


_PROBE = ("import json, platform, jax, flax, optax, orbax.checkpoint as ocp\n"
          "from corl_jax.registry import resolve_model_paths\n"
          "paths = resolve_model_paths({paths!r})\n"
          "print(json.dumps(dict(device=jax.devices()[0].device_kind, device_count=jax.device_count(),\n"
          "    versions=dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,\n"
          "                  optax=optax.__version__, orbax=ocp.__version__))))\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SETTINGS), default="paper")
    parser.add_argument("--workdir", required=True, help="run directory (emptied first); /dev/shm on the device")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--steps", type=int, default=2, help="steps of the first invocation")
    parser.add_argument("--prompts", type=int, help="prompts per step (x 8 completions; default: the size's, "
                        "16 for paper); 8 halves the sampler's KV cache, for an 80 GB card")
    parser.add_argument("--resume-steps", type=int, default=1,
                        help="steps the resumed invocation adds; 0 restores the checkpoint and stops (for a disk that "
                             "holds one checkpoint but not the two a resumed save briefly needs)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.resume_steps < 0:
        parser.error("--steps must be at least 1 and --resume-steps at least 0")
    shutil.rmtree(args.workdir, ignore_errors=True)
    Path(args.workdir).mkdir(parents=True)
    free, copies = shutil.disk_usage(args.workdir).free, 2 if args.resume_steps else 1
    if free < copies * CHECKPOINT_BYTES[args.size]:
        raise SystemExit(f"{args.workdir}: {free / 1e9:.0f} GB free, but the run holds {copies} checkpoint(s) of "
                         f"{CHECKPOINT_BYTES[args.size] / 1e9:.0f} GB. Fix: a --workdir on a filesystem with "
                         f"{copies * CHECKPOINT_BYTES[args.size] / 1e9:.0f} GB free, or --resume-steps=0 (one checkpoint)")
    env_note = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    phases: dict = {}
    # build: resolve the random: paths (config.json + tokenizer only) and record the device, in a child process so
    # that this driver never holds the accelerator.
    paths = [model_path(agent, args.size) for agent in PAPER]
    start = time.perf_counter()
    probe = subprocess.run([sys.executable, "-c", _PROBE.format(paths=paths)], cwd=REPO, capture_output=True,
                           text=True)
    if probe.returncode:
        raise SystemExit(f"phase build failed:\n{probe.stderr}")
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    phases["build"] = {"wall_s": round(time.perf_counter() - start, 2), "returncode": 0}
    partial = {"command": " ".join([sys.executable, *sys.argv]), "size": args.size, **info, "phases": phases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, command in [("first", train_command(args.workdir, args.size, args.steps, args.prompts)),
                          ("resume", train_command(args.workdir, args.size, args.steps + args.resume_steps,
                                                   args.prompts)),
                          ("eval", eval_command(args.workdir, args.size))]:
        run_phase(name, command, phases)
        Path(args.out).write_text(json.dumps(partial, indent=2))  # what is done so far, should a later phase die

    steps = [json.loads(line) for line in (Path(args.workdir) / "metrics.jsonl").read_text().splitlines() if line]
    per_step = [{k: v for k, v in row.items() if k == "step" or "time/" in k or k.startswith("memory/")
                 or k.endswith("/completion_length")} for row in steps if "time/step" in row]
    eval_cells = json.loads((Path(args.workdir) / "eval" / "results.json").read_text())
    peak = max((row.get("memory/peak_bytes_in_use", 0) for row in per_step), default=0)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "size": args.size, **info, "env": env_note,
        "agents": {agent: model_path(agent, args.size) for agent in PAPER},
        "settings": {"param_dtype": "bfloat16 (AdamW moments follow: bfloat16)", **SETTINGS[args.size],
                     **({"prompts_per_step": args.prompts} if args.prompts else {})},
        "phases": phases,
        "resume_steps": args.resume_steps,
        "steps": per_step,  # the first step of each invocation (1 and steps+1) includes compilation
        "peak_bytes_in_use": peak or None,
        "peak_gib": round(peak / 2 ** 30, 2) if peak else None,
        "checkpoint_bytes": sum(f.stat().st_size for f in (Path(args.workdir) / "checkpoints").rglob("*")
                                if f.is_file()),
        "eval": eval_cells,
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: result[k] for k in ("device", "phases", "peak_gib", "checkpoint_bytes")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
