"""Test session setup: 8 fake CPU devices for sharding tests (set before jax is imported), and compiled programs
released after every test module."""

import gc
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each XLA:CPU executable keeps ~6 memory mappings of JIT code; the whole suite in one process compiles enough
    programs to reach the kernel's vm.max_map_count (65530), and the next compile then dies with SIGSEGV (seen in
    test_voting's hypothesis test). Clearing JAX's caches after every module frees them."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
