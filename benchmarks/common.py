"""Shared benchmark helpers: the ~40M-parameter config and a timer."""

from __future__ import annotations

import time

import jax

from april_jax.models.qwen3 import Qwen3Config

# ~40M parameters: the model of the CPU benchmarks (their figures: docs/performance.md).
CONFIG_40M = Qwen3Config(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def timed(fn, *args, repeats: int = 3):
    """(best seconds over `repeats` calls after one warm-up call, last output)."""
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best, out
