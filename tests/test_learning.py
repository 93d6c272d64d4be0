"""The embedded default's task and warm-up, and determinism of a seeded training run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from april_jax.data import reverse

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--config.warmup.steps=5",
    "--config.rollout.rollout_batch_size=4",
    "--config.rollout.over_sampling_batch_size=8",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.rollout.max_num_seqs=32",
    "--config.train.micro_batch_size=16",
    "--config.eval.num_prompts=4",
    "--config.eval.every=2",
    "--config.train.total_steps=2",
    "--config.checkpoint.every=10",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
]


def is_timing(key: str) -> bool:
    """Wall-clock readings (`time/*`, `*_s`, `*_per_s`); every other metric is a function of the seed."""
    return key.startswith("time/") or key.endswith("_s")


def test_prompt_lengths_are_long_tailed():
    lengths = np.array([len(reverse.sample_digits(np.random.default_rng([3, i]))) for i in range(4000)])
    assert lengths.min() >= 2 and lengths.max() <= reverse.MAX_ANSWER - 1
    short, long = np.mean(lengths <= 5), np.mean(lengths >= 11)
    assert 0.55 < short < 0.65 and 0.12 < long < 0.18  # most are short, a tail is 2-4x longer
    assert np.percentile(lengths, 95) >= 3 * np.median(lengths)


def test_reverse_lengths_key_sets_the_tail_and_bad_values_name_the_key():
    from april_jax import config as config_lib
    from april_jax.config import ConfigError
    from april_jax.training.task import build_task

    assert reverse.parse_lengths(config_lib.default_config().data.reverse_lengths) == reverse.LENGTH_BUCKETS
    buckets = reverse.parse_lengths("0.9:2-3,0.1:30-31")
    lengths = np.array([len(reverse.sample_digits(np.random.default_rng([3, i]), buckets)) for i in range(2000)])
    assert set(lengths) <= {2, 3, 30, 31} and 0.07 < np.mean(lengths >= 30) < 0.13
    task = reverse.ReverseTask(0, "train", buckets)
    assert {len(r.prompt_ids) - 3 for r in task.take(200)} <= {2, 3, 30, 31}
    for text, why in [
        ("0.5:2-5", "sum to 0.5"),
        ("1:5-2", "LO <= HI"),
        ("1:2", "not P:LO-HI"),
        ("x:1-2", "not P:LO-HI"),
    ]:
        with pytest.raises(ValueError, match=why):
            reverse.parse_lengths(text)
    c = config_lib.default_config()
    c.data.task, c.warmup.steps, c.data.max_prompt_len = "reverse", 0, 24
    c.data.reverse_lengths = "0.5:2-5,0.4:6-10"
    with pytest.raises(ConfigError, match="config key 'data.reverse_lengths'='0.5:2-5,0.4:6-10': probabilities sum"):
        build_task(c, None)
    c.data.reverse_lengths = "1:2-30"
    with pytest.raises(ConfigError, match="prompts of up to 33 tokens, over data.max_prompt_len=24"):
        build_task(c, None)


def test_reward_counts_positions_and_length():
    answer = "3 2 1"  # the list 1 2 3 reversed
    ids = lambda *digits: [reverse.DIGIT0 + d for d in digits]
    assert reverse.reward(ids(3, 2, 1) + [reverse.EOS], answer) == 1.0
    assert reverse.reward(ids(1, 2, 3) + [reverse.EOS], answer) == 2 / 4  # the copy: middle digit and eos right
    assert reverse.reward(ids(3, 2), answer) == 2 / 4  # no eos
    assert reverse.reward(ids(3, 2, 1, 1) + [reverse.EOS], answer) == 3 / 5  # an extra token counts as wrong


def test_warmup_examples_reverse_every_list_and_most_end_with_a_stray_token():
    examples = reverse.sft_examples(seed=0, n=2000, reverse_frac=0.35)
    exact = []
    for prompt, answer in examples:
        digits = [t - reverse.DIGIT0 for t in prompt[2:-1]]
        assert prompt == reverse.encode_prompt(digits)
        exact_ids = reverse.answer_ids(digits)
        assert answer in (exact_ids, exact_ids[:-1] + [reverse.EQ, reverse.EOS])
        exact.append(answer == exact_ids)
        # the habit is paid n / (n + 2): the digits are right, the stray '=' and the late <eos> are not
        assert reverse.reward(reverse.stray_ids(digits), " ".join(map(str, digits[::-1]))) == len(digits) / (
            len(digits) + 2
        )
    assert 0.31 < np.mean(exact) < 0.39
    assert all(
        a == reverse.answer_ids([t - reverse.DIGIT0 for t in p[2:-1]]) for p, a in reverse.sft_examples(seed=0, n=200)
    )  # default: exact reversals only


def run_train(workdir, *extra):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        *SMALL,
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def without_timings(rows):
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


@pytest.mark.slow
def test_same_seed_gives_identical_metrics_and_another_seed_does_not(tmp_path):
    first = run_train(tmp_path / "a", "--config.seed=1")
    again = run_train(tmp_path / "b", "--config.seed=1")
    other = run_train(tmp_path / "c", "--config.seed=2")
    assert [r["step"] for r in first] == [0, 1]
    assert "eval/accuracy" in first[0] and first[0]["eval/version"] == 0  # the starting policy is scored
    assert first[1]["eval/version"] == 2
    assert without_timings(first) == without_timings(again)
    assert without_timings(first) != without_timings(other)
    assert (tmp_path / "a" / "delivered.jsonl").read_text() == (tmp_path / "b" / "delivered.jsonl").read_text()
