"""Shared pieces of the GPU benchmarks: device facts, measured peaks, the dry-run shapes.

Each gpu_*.py benchmark prints one JSON object per line (a line per configuration as it finishes,
so a run cut short by `scripts/device_check.sh`'s time budget keeps what it measured). With
`--dry-run` they run the same code on tiny shapes on whatever backend JAX has (CPU here), to
prove the script on a CPU before a short GPU run.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp

from april_jax.models.qwen3 import PRESETS, Qwen3Config

# Spec-sheet HBM bandwidth (bytes/s) of the GPUs users run on, by a substring of device_kind. The
# roofline uses it; the measured copy bandwidth is reported beside it.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}

# Shapes for --dry-run: every code path of the real run, seconds on 2 CPU cores.
TINY = Qwen3Config(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def model_config(name: str) -> Qwen3Config:
    """A preset (qwen3-0.6b, qwen3-1.7b, ...) or "tiny"."""
    if name == "tiny":
        return TINY
    if name not in PRESETS:
        raise SystemExit(f"unknown model {name!r}; expected 'tiny' or one of {sorted(PRESETS)}")
    return PRESETS[name]


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def device_info() -> dict:
    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
    }


def spec_hbm_bytes_per_s() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in kind), None)


def best_seconds(fn, *args, repeats: int = 5) -> float:
    """Best wall time of `fn(*args)` (blocked on) over `repeats` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def bf16_matmul_peak_flops(n: int, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n bf16 matmul (fp32 accumulation, bf16 out), the peak MFU divides by.
    Random data: zeros run ~13% faster on an H200 (less switching power), which would flatter it."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / best_seconds(f, a, b, repeats=repeats)


def copy_bandwidth_bytes_per_s(nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by an elementwise pass over a bf16 array of `nbytes`."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    return 2 * nbytes / best_seconds(f, x, repeats=repeats)


def device_peak_bytes() -> int | None:
    """Peak device memory in use so far (None where the backend does not say, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")
