"""Environment for subprocesses (trainer, eval) that share one persistent compilation cache: a later run of the
same programs reads the executables the first one wrote instead of compiling them again (bit for bit the same)."""

from pathlib import Path


def compilation_cache_env(directory: str | Path) -> dict[str, str]:
    """JAX settings (as environment variables) that cache every compiled program in `directory`."""
    return {"JAX_COMPILATION_CACHE_DIR": str(directory), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
