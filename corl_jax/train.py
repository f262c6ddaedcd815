"""Train a Co-RL cohort (or a baseline): `python -m corl_jax.train --config=configs/ring3.py[:variant] --workdir=DIR`.

Any config key can be overridden, e.g. `--config.rollout.num_generations=4`; an unknown key is an error that names
it. A workdir that already holds checkpoints is resumed from its latest step (unless `--config.train.resume=False`).
On several hosts, launch the same command on every host: `jax.distributed` is initialised from the environment
(Cloud TPU VMs, SLURM, JAX_COORDINATOR_ADDRESS) or from --coordinator_address/--num_processes/--process_id.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file, optionally with ':variant'.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard, summary.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", None, "Call jax.distributed.initialize() (default: when a multi-host environment is detected "
    "or --coordinator_address is given).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (default: auto-detected).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (default: auto-detected).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (default: auto-detected).")


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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None or not _WORKDIR.value:
        raise app.UsageError("both --config=configs/<name>.py[:variant] and --workdir=DIR are required")
    if not flags.FLAGS["verbosity"].present:  # keep the console to the progress bar; --verbosity=0 shows INFO logs
        logging.set_verbosity(logging.WARNING)
    from corl_jax import multihost

    distributed = _DISTRIBUTED.value
    if distributed is None:
        distributed = _COORDINATOR.value is not None or multihost.multi_host_environment()
    if distributed:
        multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    from corl_jax.config import validate
    from corl_jax.loop import train

    config = _CONFIG.value
    validate(config)
    logging.info("config:\n%s", config)
    train(config, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
