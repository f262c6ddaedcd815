"""Test session setup: 8 fake CPU devices for sharding tests and quick XLA:CPU compiles (tests/cpu_flags.py; set
before jax is imported, subprocesses inherit them), one persistent compilation cache for the session, and compiled programs
released after every test module."""

import gc
import os

import pytest

from cpu_flags import session_xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = session_xla_flags(os.environ.get("XLA_FLAGS", ""))


@pytest.fixture(autouse=True, scope="session")
def _session_compilation_cache(tmp_path_factory):
    """One persistent compilation cache shared by both xdist workers and, through the environment, every trainer or
    eval subprocess: a program is compiled once per session and read back, bit for bit the same executable, by every
    later process that needs it (a tiny ring3 run spends about 2/3 of its time compiling on 2 CPU cores)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    base = tmp_path_factory.getbasetemp()  # a worker's is <session>/popen-gwN
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compilation_cache"
    directory.mkdir(exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(directory), "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    os.environ.update({name.upper(): str(value) for name, value in settings.items()})
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # in case a test module compiled at import, before the cache was set


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each XLA:CPU executable keeps ~6 memory mappings of JIT code; the whole suite in one process compiles enough
    programs to reach the kernel's vm.max_map_count (65530), and the next compile then dies with SIGSEGV (seen in
    test_voting's hypothesis test). Clearing JAX's caches after every module frees them."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
