"""Train a Co-RL cohort (or a baseline): `python -m corl_jax.train --config=configs/ring3.py[:variant] --workdir=DIR`.

Any config key can be overridden, e.g. `--config.rollout.num_generations=4`; an unknown key is an error that names
it. A workdir that already holds checkpoints is resumed from its latest step (unless `--config.train.resume=False`).
On several hosts, launch the same command on every host: `jax.distributed` is initialised from the environment.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file, optionally with ':variant'.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard, summary.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", None, "Call jax.distributed.initialize() (default: when a multi-host environment is detected).")


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with config-override errors turned into one readable line."""
    try:
        return flags.FLAGS(argv)
    except AttributeError as e:  # ml_collections: override of a key the config does not have
        detail = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e)
        sys.exit(f"error: a --config.* override names a key the config does not have: {detail}\n"
                 "Fix: correct the key; the valid keys are those of the config file (printed at start).")
    except flags.Error as e:
        sys.exit(f"error: {e}")


def _multi_host_environment() -> bool:
    return any(v in os.environ for v in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS"))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None or not _WORKDIR.value:
        raise app.UsageError("both --config=configs/<name>.py[:variant] and --workdir=DIR are required")
    if not flags.FLAGS["verbosity"].present:  # keep the console to the progress bar; --verbosity=0 shows INFO logs
        logging.set_verbosity(logging.WARNING)
    distributed = _DISTRIBUTED.value if _DISTRIBUTED.value is not None else _multi_host_environment()
    if distributed:
        import jax

        jax.distributed.initialize()
    from corl_jax.config import validate
    from corl_jax.loop import train

    config = _CONFIG.value
    validate(config)
    logging.info("config:\n%s", config)
    train(config, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
