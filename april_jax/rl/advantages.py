"""Group-relative advantages (GRPO, Dr. GRPO, RLOO) and DAPO's overlong reward shaping.

`rewards_GN` holds the rewards of G groups of N samples each.
"""

from __future__ import annotations

import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")


def group_advantages(rewards_GN, *, mode: str = "grpo", eps: float = 1e-6, batch_norm: bool = False):
    """Per-sample advantages [G, N].

    grpo:   (r - mean_g) / (std_g + eps), std unbiased as in verl
    drgrpo: r - mean_g (no std; Dr. GRPO)
    rloo:   r - mean of the other N-1 samples of the group
    batch_norm: afterwards, normalise by the std over the whole batch (REINFORCE++-style).
    """
    r = jnp.asarray(rewards_GN, jnp.float32)
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode {mode!r}: expected one of {ADVANTAGE_MODES}")
    mean = r.mean(axis=1, keepdims=True)
    if mode == "grpo":
        # Unbiased std (ddof=1), as verl's torch.std; a group of one has std 0 -> advantage 0.
        std = jnp.std(r, axis=1, keepdims=True, ddof=1) if r.shape[1] > 1 else jnp.zeros_like(mean)
        adv = (r - mean) / (std + eps)
    elif mode == "drgrpo":
        adv = r - mean
    else:
        n = r.shape[1]
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        adv = r - (r.sum(axis=1, keepdims=True) - r) / (n - 1)
    if batch_norm:
        adv = (adv - adv.mean()) / (adv.std() + eps)
    return adv


def overlong_penalty(lengths, max_len: int, buffer: int, factor: float = 1.0):
    """DAPO soft overlong punishment, in tokens: 0 up to max_len - buffer, then linearly down to
    -factor at max_len: -min(max(L - (max_len - buffer), 0) / buffer, 1) * factor."""
    lengths = jnp.asarray(lengths, jnp.float32)
    return -jnp.minimum(jnp.maximum(lengths - (max_len - buffer), 0.0) / buffer, 1.0) * factor
