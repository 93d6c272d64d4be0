"""Delivered groups -> the train batch: token alignment, group advantages, and the padded lengths
(each one a train-step compile)."""

import numpy as np
import pytest

from april_jax.rl.batch import groups_to_batch, pad_length
from april_jax.rollout.types import Group, PromptRecord, Sample


def group(gid, prompt_ids, responses, rewards):
    samples = [
        Sample(
            list(prompt_ids),
            gid,
            i,
            response_ids=list(r),
            response_logprobs=[-0.5 - 0.1 * j for j in range(len(r))],
            response_versions=[3] * len(r),
            status="completed",
            reward=w,
        )
        for i, (r, w) in enumerate(zip(responses, rewards))
    ]
    return Group(gid, PromptRecord(gid, list(prompt_ids)), samples)


def test_tokens_align_to_the_position_that_predicts_them():
    groups = [group("a", [5, 6, 7], [[8, 9], [10]], [1.0, 0.0]), group("b", [11], [[12, 13, 14], [15]], [0.0, 0.0])]
    batch = groups_to_batch(groups, pad_multiple=8)
    assert batch["input_ids"].shape == (4, 8) and batch["loss_mask"].shape == (4, 7)
    np.testing.assert_array_equal(batch["input_ids"][0], [5, 6, 7, 8, 9, 0, 0, 0])
    # position 2 (token 7) predicts token 8, position 3 predicts 9
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(batch["behaviour_logp"][0, 2:4], [-0.5, -0.6])
    np.testing.assert_array_equal(batch["versions"][2], [3, 3, 3, 0, 0, 0, 0])
    # GRPO: (r - mean) / (unbiased std + eps) within each group; a group of equal rewards gives 0
    np.testing.assert_allclose(batch["advantages"], [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0, 0], rtol=1e-5)


def test_padded_lengths_are_few_and_never_past_the_runs_longest_sequence():
    longest = 1024 + 16384  # configs/qwen3_4b.py: prompt + response budget
    sizes = {n: pad_length(n, 32, longest) for n in range(1, longest + 1)}
    assert all(size >= n and size % 32 == 0 for n, size in sizes.items())
    assert max(sizes.values()) == longest  # the budget itself, not the next bucket above it
    # one compile per distinct length: ~30 instead of one per multiple of 32 (544)
    assert len(set(sizes.values())) <= 40
    assert all(size - n < 0.25 * size for n, size in sizes.items() if n > 256)
    # short lengths keep every multiple: a 128-token budget compiles at most 4 lengths
    assert sorted({pad_length(n, 32, 128) for n in range(1, 129)}) == [32, 64, 96, 128]
    assert [pad_length(n) for n in (1, 33, 257, 321, 513)] == [32, 64, 320, 384, 640]


@pytest.mark.parametrize("response_len,expected", [(2, 64), (40, 96), (100, 160)])
def test_batch_width_follows_the_padded_length(response_len, expected):
    g = group("a", list(range(1, 51)), [[1] * response_len, [2]], [1.0, 0.0])
    assert groups_to_batch([g], max_len=50 + 110)["input_ids"].shape == (2, expected)
