"""The persistent XLA compilation cache of a training run (`train.compile_cache_dir`).

A restarted or repeated run loads the programs an earlier run compiled instead of compiling them
again (on a GPU the train step of a 4B model compiles for minutes; the tiny config's ~70 programs
take ~50 s on 2 CPU cores). A hit loads the very executable a compile would make, so metrics do
not change (tests/test_train.py runs with a warm cache and compares against cold runs).

Which folder: `train.compile_cache_dir` ('' turns the cache off), unless the environment names one
in JAX's own `JAX_COMPILATION_CACHE_DIR` (the test session and scripts/device_check.sh share theirs
that way). Entries are written for programs that took >= MIN_COMPILE_SECONDS to compile; the folder
is kept under MAX_BYTES (oldest evicted), which also turns on JAX's file lock, so processes sharing
the folder (several runs, or the processes of one run) never read a half-written entry. Each setting
yields to its JAX_* environment variable when that is set.
"""

from __future__ import annotations

import os

from april_jax.config.schema import ConfigError

MIN_COMPILE_SECONDS = 0.2  # the tiny engine's programs compile in 0.2-3 s; JAX's default (1 s) skips most
MAX_BYTES = 8 << 30


def enable(directory: str) -> str | None:
    """Point JAX's persistent cache at `directory` (or the environment's folder); '' turns it off.
    Returns the folder in use (made if missing), or None when off; a folder that cannot be made is a
    ConfigError naming it. Call before the first compile."""
    import jax

    if not directory:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    env_path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    path = env_path or os.path.expanduser(directory)
    try:  # JAX would only warn, once per program, and run uncached
        # owner-only when made here: an entry is an executable the next run loads and runs
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        source = "JAX_COMPILATION_CACHE_DIR" if env_path else "train.compile_cache_dir"
        raise ConfigError(
            f"{source}={path!r}: cannot make the compilation cache folder ({e.strerror}); name a "
            f"writable folder, or set train.compile_cache_dir= (empty) to turn the cache off"
        ) from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
