"""compile_cache.enable: which folder the persistent XLA cache uses, that a second process loads
what the first compiled, and that '' turns it off. Each case runs in a fresh process (the cache
settings are process-wide and the test session has its own cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from april_jax.runtime import compile_cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
folder = compile_cache.enable(sys.argv[1])
x = jnp.arange(64.0).reshape(8, 8)
print(json.dumps({"folder": folder, "value": float(jax.jit(lambda a: (a @ a.T).sum() + 1.0)(x)), "hits": len(hits),
                  "enabled": jax.config.jax_enable_compilation_cache}))
"""


def run(directory: str, env_folder: str | None = None, home: Path | None = None, check: bool = True):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    if home is not None:
        env["HOME"] = str(home)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the test's program compiles in milliseconds
    if env_folder is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = env_folder
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, directory], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.exists() else []


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    folder = tmp_path / "xla"
    first = run(str(folder))
    assert first["folder"] == str(folder) and first["enabled"] and first["hits"] == 0
    assert entries(folder), "nothing written to the cache folder"
    second = run(str(folder))
    assert second["hits"] >= 1 and second["value"] == first["value"]


def test_the_environment_folder_wins_over_the_key(tmp_path):
    key_folder, env_folder = tmp_path / "key", tmp_path / "env"
    out = run(str(key_folder), env_folder=str(env_folder))
    assert out["folder"] == str(env_folder)
    assert entries(env_folder) and not entries(key_folder)


def test_an_empty_key_turns_the_cache_off_even_with_an_environment_folder(tmp_path):
    env_folder = tmp_path / "env"
    out = run("", env_folder=str(env_folder))
    assert out["folder"] is None and not out["enabled"]
    assert not entries(env_folder)


def test_the_default_folder_is_made_under_home(tmp_path):
    from april_jax import config as config_lib

    out = run(config_lib.Train().compile_cache_dir, home=tmp_path)
    folder = tmp_path / ".cache" / "april_jax" / "xla"
    assert out["folder"] == str(folder) and entries(folder)
    assert folder.stat().st_mode & 0o077 == 0, "the cache folder it made is not owner-only"


def test_a_folder_that_cannot_be_made_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = run(str(tmp_path / "a_file" / "xla"), check=False)
    assert proc.returncode != 0
    assert f"ConfigError: train.compile_cache_dir='{tmp_path / 'a_file' / 'xla'}': cannot make" in proc.stderr
