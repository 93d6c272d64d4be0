"""Supervised warm-up: teacher-forced cross-entropy on answer tokens (used to start RL from a
policy with non-zero reward when a model is trained from scratch)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from april_jax.models.qwen3 import Qwen3


def pack(examples: Sequence[tuple[list[int], list[int]]], pad_to: int | None = None):
    """(input_ids [B, S], loss_mask [B, S-1]) with the mask on positions predicting answer tokens."""
    S = pad_to or max(len(p) + len(a) for p, a in examples)
    ids = np.zeros((len(examples), S), np.int32)
    mask = np.zeros((len(examples), S - 1), np.float32)
    for row, (p, a) in enumerate(examples):
        ids[row, : len(p) + len(a)] = p + a
        mask[row, len(p) - 1 : len(p) - 1 + len(a)] = 1
    return ids, mask


def warmup(
    model: Qwen3, examples, *, steps: int, lr: float, batch_size: int, seed: int = 0, should_stop=None
) -> list[float]:
    """Train `model` in place; returns the loss per step. `should_stop()` true ends it after the
    step in progress (a stop signal: the caller saves nothing of a warm-up cut short)."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 10))
    opt_state = tx.init(params)
    pad_to = max(len(p) + len(a) for p, a in examples)

    @jax.jit
    def step(params, opt_state, ids, mask):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(ids[:, :-1])
            logp = jax.nn.log_softmax(logits, -1)
            nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
            return (nll * mask).sum() / mask.sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        if should_stop is not None and should_stop():
            break
        batch = [examples[i] for i in rng.integers(0, len(examples), batch_size)]
        ids, mask = pack(batch, pad_to)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids), jnp.asarray(mask))
        losses.append(float(loss))
    nnx.update(model, params)
    return losses
