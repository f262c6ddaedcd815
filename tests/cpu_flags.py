"""The test session's XLA:CPU flags (tests/conftest.py sets them before jax is imported; subprocesses inherit them).

The tests' programs are tiny and most run a few times, so compiling them costs more than running them: LLVM at -O0
without its expensive passes (the same HLO and fusions; a tiny ring3 trainer run takes 109 s instead of 160 s, a demo
base builds in 40 s instead of 54 s)."""

import os
import re

TEST_XLA_FLAGS = {"--xla_force_host_platform_device_count": "8", "--xla_backend_optimization_level": "0",
                  "--xla_llvm_disable_expensive_passes": "true"}


def session_xla_flags(existing: str) -> str:
    """`existing` XLA_FLAGS plus every test flag it does not set already."""
    return " ".join([existing] + [f"{flag}={value}" for flag, value in TEST_XLA_FLAGS.items()
                                  if flag not in existing]).strip()


def xla_flags_with_devices(devices: int) -> str:
    """This session's XLA_FLAGS for a subprocess with `devices` fake CPU devices."""
    return re.sub(r"device_count=\d+", f"device_count={devices}", os.environ["XLA_FLAGS"])
