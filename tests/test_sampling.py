"""Sampling: the greedy pick, and drawn tokens against the distribution they claim to follow."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.rollout import sampling


def test_greedy_pick_is_the_first_argmax_even_with_ties():
    logits = np.array(
        [[0.0, 3.0, 3.0, 1.0], [-np.inf, -np.inf, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0], [1.0, 0.0, -1.0, 0.0]], np.float32
    )
    tokens, logprobs = sampling.sample(
        jnp.asarray(logits), None, jnp.zeros(4), jnp.ones(4), jnp.zeros(4, jnp.int32), mode="greedy"
    )
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    expected = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))[np.arange(4), np.argmax(logits, axis=-1)]
    np.testing.assert_allclose(logprobs, expected, atol=1e-6)


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampled_tokens_follow_the_softmax(top_k):
    """20000 draws from one row against its probabilities (temperature 0.5; with top-k 3, the
    renormalised top 3). Mass sits at block edges (DRAW_BLOCK = 128) and in the padded last block."""
    V, N, temperature = 300, 20000, 0.5
    logits = np.full(V, -6.0, np.float32)
    heavy = [0, 127, 128, 200, 255, 256, 299]
    logits[heavy] = np.linspace(0.0, 1.2, len(heavy))
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits) / temperature))
    if top_k:
        keep = np.argsort(-probs)[:top_k]
        probs = np.where(np.isin(np.arange(V), keep), probs, 0.0)
        probs = probs / probs.sum()
    keys = sampling.request_keys(jnp.arange(N, dtype=jnp.int32), jnp.zeros(N, jnp.int32))
    tokens, _ = jax.jit(partial(sampling.sample, mode="truncate" if top_k else "sample"))(
        jnp.broadcast_to(jnp.asarray(logits), (N, V)),
        keys,
        jnp.full(N, temperature),
        jnp.ones(N),
        jnp.full(N, top_k, jnp.int32),
    )
    counts = np.bincount(np.asarray(tokens), minlength=V)
    expected = N * probs
    assert counts[probs == 0].sum() == 0
    # Within 4.5 binomial standard deviations (+1 for tiny expectations) for every token.
    assert np.all(np.abs(counts - expected) <= 4.5 * np.sqrt(expected * (1 - probs)) + 1), (
        counts[heavy],
        expected[heavy],
    )
    assert counts[heavy].sum() > 0.9 * N
