"""Batch generation with the KV cache: one prefill, then a `lax.scan` of one-token decode steps.

A plain function for demos, evaluation and tests. Rollouts for training go through the engines in
`april_jax/rollout/`, which add continuous batching, abort and per-token policy versions.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from april_jax.models.qwen3 import KVCache, Qwen3


def sample_token(logits_BV, key, temperature):
    """Greedy when temperature == 0, else a categorical draw at `temperature`."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if temperature == 0.0:
        return greedy
    return jax.random.categorical(key, logits_BV / temperature, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature"))
def _generate(graphdef, state, tokens_BT, lengths_B, key, *, max_new_tokens: int, temperature: float):
    model = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    cache = KVCache.zeros(model.cfg, B, T + max_new_tokens)
    logits_BTV, cache = model.forward(tokens_BT, cache=cache, num_new_B=lengths_B)
    last_BV = jnp.take_along_axis(logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]

    def step(carry, key):
        cache, logits_BV = carry
        token_B = sample_token(logits_BV, key, temperature)
        logits_B1V, cache = model.forward(token_B[:, None], cache=cache)
        return (cache, logits_B1V[:, 0]), token_B

    _, tokens_NB = jax.lax.scan(step, (cache, last_BV), jax.random.split(key, max_new_tokens))
    return tokens_NB.T


def generate(model: Qwen3, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, stop_ids: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
    """New token ids for each prompt, cut after the first stop id (which is kept)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    graphdef, state = nnx.split(model)
    out = np.asarray(_generate(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed),
                               max_new_tokens=max_new_tokens, temperature=float(temperature)))
    results = []
    for row in out.tolist():
        stop_at = next((i for i, t in enumerate(row) if t in set(stop_ids)), None)
        results.append(row if stop_at is None else row[: stop_at + 1])
    return results
