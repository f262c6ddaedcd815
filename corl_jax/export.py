"""Export trained agents as plain Hugging Face checkpoints:
`python -m corl_jax.export --workdir=DIR [--step=best|latest|N] [--agents=a,b] --out=OUT [--dtype=bfloat16|float32]`.

Writes `OUT/<agent>/` (config.json, model.safetensors, tokenizer files with the chat template the agent trained
with, generation_config.json) for every agent of the run (or those of --agents). `--step=best` is each agent's own
best evaluated step; an agent that no step improved on exports its base weights (step 0). Only each agent's
parameters are read from the checkpoint, never the optimiser state. The same step exported twice gives identical
bytes. Nothing existing is overwritten: an existing `OUT/<agent>` is an error.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from absl import app, flags, logging

DTYPES = ("bfloat16", "float32")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (defined only when the command runs, so the CLI modules import side by side)."""
    flags.DEFINE_string("workdir", None, "Run directory written by corl_jax.train.")
    flags.DEFINE_string("out", None, "Output directory; one Hugging Face checkpoint per agent in OUT/<agent>/.")
    flags.DEFINE_string("step", "best", "best (each agent's own best eval step), latest, or a step number "
                        "(0 = the base model).")
    flags.DEFINE_list("agents", None, "Agents to export (default: all of the run).")
    flags.DEFINE_string("dtype", "bfloat16", f"Weight dtype of the export: one of {DTYPES}.")


def export(workdir: str, out: str, *, step: str | int = "best", agents: list[str] | None = None,
           dtype: str = "bfloat16") -> dict[str, tuple[Path, int]]:
    """Export `agents` (default: all) of the run in `workdir` to `out/<agent>/`; returns agent -> (dir, step).

    Every agent, step and output directory is checked before anything is written (RunError / ValueError)."""
    import jax.numpy as jnp

    from corl_jax.models import save_pretrained
    from corl_jax.runs import RunError, load_agent, open_run

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {DTYPES}")
    run = open_run(workdir)
    agents = list(run.agents) if not agents else list(dict.fromkeys(agents))  # (a repeated name exports once)
    steps = {agent: run.resolve_step(agent, step) for agent in agents}  # every bad agent/step before any write
    targets = {agent: Path(out) / agent for agent in agents}
    for target in targets.values():
        if target.exists():
            raise RunError(f"{target} already exists; choose another --out or delete it first")
    written = {}
    for agent in agents:
        policy, resolved = load_agent(run.workdir, agent, steps[agent], dtype=getattr(jnp, dtype))
        written[agent] = (_write_atomically(targets[agent], lambda d, p=policy: save_pretrained(p, d)), resolved)
    return written


def _write_atomically(target: Path, write) -> Path:
    """`write(dir)` into a temporary sibling renamed to `target` when complete: no half-written export."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's (and safetensors') owner-only modes would otherwise be the export's
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}", exitcode=2)
    if not FLAGS.workdir or not FLAGS.out:
        raise app.UsageError("both --workdir=DIR (a run of corl_jax.train) and --out=OUT are required", exitcode=2)
    if not flags.FLAGS["verbosity"].present:  # keep the console to the result lines; --verbosity=0 shows INFO logs
        logging.set_verbosity(logging.WARNING)
    try:
        written = export(FLAGS.workdir, FLAGS.out, step=FLAGS.step, agents=FLAGS.agents, dtype=FLAGS.dtype)
    except (ValueError, FileNotFoundError) as e:  # runs.RunError and the loaders' errors: one line naming the fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for agent, (directory, step) in written.items():
        print(f"{agent}: step {step}{' (base model)' if step == 0 else ''} -> {directory}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
