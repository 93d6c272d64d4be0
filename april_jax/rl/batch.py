"""Delivered groups -> the train batch (token-aligned arrays, advantages from group rewards)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from april_jax.rl.advantages import group_advantages
from april_jax.rollout.types import Group


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_length(n: int, multiple: int = 32, max_len: int | None = None) -> int:
    """The train batch's padded length for a longest sequence of `n` tokens: every jitted train
    step compiles once per length, so lengths come from a short list. Multiples of `multiple` up to
    8 of them, then four sizes per doubling (10, 12, 14, 16, 20, 24, ... multiples: at most a
    quarter of padding), so 17k-token sequences meet ~30 lengths, not one per multiple; never past
    `max_len` (the run's longest prompt + response) rounded up to `multiple`."""
    size = max(multiple, _round_up(n, multiple))
    if size > 8 * multiple:
        octave = 8 * multiple
        while size > 2 * octave:
            octave *= 2
        size = _round_up(size, octave // 4)
    cap = max(multiple, _round_up(max_len, multiple)) if max_len else None
    return min(size, cap) if cap is not None and n <= cap else size


def groups_to_batch(
    groups: Sequence[Group],
    *,
    advantage_mode: str = "grpo",
    batch_norm: bool = False,
    pad_multiple: int = 32,
    max_len: int | None = None,
    rewards_GN=None,
) -> dict:
    """input_ids [B, S]; loss_mask / behaviour_logp / versions [B, S-1] aligned to the predicted
    token; advantages [B]; rewards [B]. Rows are group-major (B = groups x n)."""
    if not groups:
        raise ValueError("groups_to_batch: no groups")
    if rewards_GN is None:
        rewards_GN = np.array([[s.reward for s in g.samples] for g in groups], np.float32)
    adv = np.asarray(group_advantages(rewards_GN, mode=advantage_mode, batch_norm=batch_norm)).reshape(-1)
    samples = [s for g in groups for s in g.samples]
    S = pad_length(max(len(s.prompt_ids) + len(s.response_ids) for s in samples), pad_multiple, max_len)
    B = len(samples)
    input_ids = np.zeros((B, S), np.int32)
    loss_mask = np.zeros((B, S - 1), np.float32)
    behaviour = np.zeros((B, S - 1), np.float32)
    versions = np.zeros((B, S - 1), np.int32)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, :p] = s.prompt_ids
        input_ids[row, p : p + r] = s.response_ids
        # position t predicts token t + 1: response token j sits at p + j, predicted at p + j - 1
        loss_mask[row, p - 1 : p - 1 + r] = 1.0
        behaviour[row, p - 1 : p - 1 + r] = s.response_logprobs
        versions[row, p - 1 : p - 1 + r] = s.response_versions
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "behaviour_logp": behaviour,
        "versions": versions,
        "advantages": adv.astype(np.float32),
        "rewards": np.asarray(rewards_GN, np.float32).reshape(-1),
    }
