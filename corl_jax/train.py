"""Train a Co-RL cohort (or a baseline): `python -m corl_jax.train --config=configs/ring3.py[:variant] --workdir=DIR`.

Any config key can be overridden, e.g. `--config.rollout.num_generations=4`; an unknown key is an error that names
it. A used workdir is resumed from its latest good checkpoint; `--config.train.restart=True` moves its old run aside
and starts afresh (docs/faults.md: what is guaranteed, and the exit statuses).
On several hosts, launch the same command on every host: `jax.distributed` is initialised from the environment
(Cloud TPU VMs, SLURM, JAX_COORDINATOR_ADDRESS) or from --coordinator_address/--num_processes/--process_id
(docs/multihost.md).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The trainer's command line (defined only when a command runs, so the CLI modules import side by side)."""
    config_flags.DEFINE_config_file("config", None, "Experiment config file, optionally with ':variant'.")
    flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard, summary.")
    flags.DEFINE_bool("distributed", None, "Call jax.distributed.initialize() (default: when a multi-host environment "
                      "is detected or --coordinator_address is given).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (default: auto-detected).")
    flags.DEFINE_integer("num_processes", None, "Number of processes (default: auto-detected).")
    flags.DEFINE_integer("process_id", None, "This process's index (default: auto-detected).")
    flags.DEFINE_integer("heartbeat_timeout_seconds", None, "Seconds without a heartbeat after which a process "
                         "counts as dead and every process is stopped (default: JAX's, 100).", lower_bound=1)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with config-override errors turned into one readable line."""
    try:
        argv = flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error) as e:
        message = _unknown_override(argv)
        if message:
            _exit_usage(message)
        if isinstance(e, flags.Error):  # a config file that raised: its traceback's last line names the problem
            lines = [line for line in str(e).splitlines() if line.strip()]
            _exit_usage(f"{lines[0].split(':')[0]}: {lines[-1]}" if lines else type(e).__name__)
        detail = e.args[0].args[0] if e.args and isinstance(e.args[0], KeyError) else str(e.args[0] if e.args else e)
        _exit_usage(f"a --config.* override could not be applied: {' '.join(str(detail).split())}")
    path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0] if flags.FLAGS["config"].present \
        else None
    if path is not None and not os.path.isfile(path):
        _exit_usage(f"config file {path} does not exist. Fix: pass --config=configs/<name>.py[:variant]")
    return argv


def _unknown_override(argv: list[str]) -> str | None:
    """The error for the first `--config.<key>` override in `argv` that names no key of the config file's config."""
    overrides = [arg.lstrip("-").split("=", 1)[0] for arg in argv[1:]]
    overrides = [name.split(".", 1)[1] for name in overrides if name.startswith(("config.", "noconfig."))]
    if not overrides:
        return None
    from corl_jax.config import unknown_key_error

    plain = [arg for i, arg in enumerate(argv) if i == 0 or not arg.lstrip("-").startswith(("config.", "noconfig."))]
    values = flags.FlagValues()  # the config file alone, without the overrides that failed
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=plain)
    try:
        values(plain, known_only=True)
    except (flags.Error, AttributeError, KeyError):  # the file itself fails: the caller reports that
        return None
    if values.config is None:
        return None
    return next((m for m in (unknown_key_error(values.config, key) for key in overrides) if m), None)


def _exit_usage(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.config is None or not FLAGS.workdir:
        raise app.UsageError("both --config=configs/<name>.py[:variant] and --workdir=DIR are required")
    if not flags.FLAGS["verbosity"].present:  # keep the console to the progress bar; --verbosity=0 shows INFO logs
        logging.set_verbosity(logging.WARNING)
    from corl_jax import multihost

    distributed = FLAGS.distributed
    if distributed is None:
        distributed = FLAGS.coordinator_address is not None or multihost.multi_host_environment()
    if distributed:
        multihost.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                             FLAGS.heartbeat_timeout_seconds)
    sys.exit(run(FLAGS.config, FLAGS.workdir))


def run(config, workdir: str) -> int:
    """Validate `config` and train in `workdir`; returns the exit status: 0 done; 1 training failed (non-finite
    values); 2 a bad config, data source, model path, workdir or checkpoint (one line, before any step when it can);
    3 done, but after recovering from a fault (summary.json lists it); 130/143 stopped by SIGINT/SIGTERM after
    saving a checkpoint."""
    from corl_jax import multihost
    from corl_jax.checkpointing import CheckpointError
    from corl_jax.config import ConfigError, validate
    from corl_jax.data import DataError
    from corl_jax.loop import Interrupted, StopRequest, train
    from corl_jax.workdir import WorkdirError

    try:
        differ = multihost.disagreeing_processes(config.to_json_best_effort(sort_keys=True))
        if differ:
            raise ConfigError(f"process(es) {differ} resolved another config than process 0 (a slice whose hosts "
                              "disagree on the config). Fix: run the same command, with the same config file and "
                              "data, on every host")
        validate(config)
        logging.info("config:\n%s", config)
        with StopRequest() as stop:
            summary = train(config, workdir, stop)
    except (ConfigError, DataError, WorkdirError, CheckpointError, FileNotFoundError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(e, file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted: stopped at once; the last saved checkpoint stands", file=sys.stderr)
        return 130
    if summary["faults"]:
        if multihost.is_main():
            print("finished, but after recovering from: " + "; ".join(summary["faults"]), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=_parse_flags)
