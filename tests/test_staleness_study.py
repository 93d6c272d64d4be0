"""The staleness study's summaries on metrics rows shaped like the trainer's (benchmarks/staleness_study.py)."""

import numpy as np
import pytest

from benchmarks.staleness_study import eval_curve, summarize_run, summarize_study

GROUPS, N = 16, 8  # the tiny config's rollout_batch_size and n_samples_per_prompt
WARMUP_S = 50.0


def run_rows(steps: int, eval_every: int, rng, off_policy: bool, accuracy_end: float) -> list[dict]:
    """metrics.jsonl rows as the trainer writes them: step 0 carries the eval of the starting policy
    (version 0), step s with (s + 1) % eval_every == 0 the eval of version s + 1; `time/elapsed_s`
    counts from the start of the process (the warm-up included)."""
    rows, elapsed = [], WARMUP_S
    for step in range(steps):
        rollout_s, train_s, sync_s = rng.uniform(0.05, 0.2), rng.uniform(0.2, 0.4), 0.01
        elapsed += rollout_s + train_s + sync_s
        row = {
            "step": step,
            "version": step + 1,
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            "time/elapsed_s": elapsed,
            "time/rollout_compile_s": 0.0,
            "rollout/groups": GROUPS,
            "rollout/tokens": int(rng.integers(600, 1200)),
            "rollout/off_policy_token_frac": float(rng.uniform(0, 1)) if off_policy and step else 0.0,
            "train/off_policy_token_frac": float(rng.uniform(0, 1)) if off_policy and step else 0.0,
            "rollout/staleness_mean": float(rng.uniform(0, 2)) if off_policy else 0.0,
            "rollout/staleness_max": int(rng.integers(0, 3)) if off_policy else 0,
            "rollout/stale_restarts": 1,
            "rollout/dropped_tokens": 3,
            "reward/mean": rng.uniform(0.7, 1.0),
            "rollout/occupancy": 0.8,
            "rollout/response_len/mean": 7.0,
            "rollout/aborted": 10,
        }
        if step == 0:
            row.update({"eval/version": 0, "eval/accuracy": 0.0})
        elif (step + 1) % eval_every == 0:
            row.update({"eval/version": step + 1, "eval/accuracy": accuracy_end * (step + 1) / steps})
        rows.append(row)
    return rows


def test_eval_curve_counts_the_responses_and_tokens_of_the_steps_before_each_eval():
    rows = run_rows(30, 10, np.random.default_rng(0), off_policy=True, accuracy_end=0.6)
    curve = eval_curve(rows, N)
    assert [p["version"] for p in curve] == [0, 10, 20, 30]
    assert [p["samples"] for p in curve] == [v * GROUPS * N for v in (0, 10, 20, 30)]  # steps x batch
    assert [p["tokens"] for p in curve] == [sum(r["rollout/tokens"] for r in rows[:v]) for v in (0, 10, 20, 30)]
    # RL seconds: 0 at the step-0 eval (the warm-up left out), then the elapsed time after step v - 1
    rl_start = rows[0]["time/elapsed_s"] - rows[0]["time/rollout_s"] - rows[0]["time/train_s"] - rows[0]["time/sync_s"]
    assert rl_start == pytest.approx(WARMUP_S)
    assert [p["rl_wall_s"] for p in curve] == pytest.approx(
        [0.0] + [rows[v - 1]["time/elapsed_s"] - WARMUP_S for v in (10, 20, 30)]
    )
    assert curve[-1]["accuracy"] == pytest.approx(0.6)


def test_off_policy_token_fraction_weights_each_step_by_its_tokens():
    """Half of 10 tokens then none of 30: 5 of 40 tokens off-policy (0.125, not the steps' mean 0.25)."""
    rows = run_rows(2, 1, np.random.default_rng(1), off_policy=False, accuracy_end=0.0)
    rows[0].update({"rollout/tokens": 10, "rollout/off_policy_token_frac": 0.5})
    rows[1].update({"rollout/tokens": 30, "rollout/off_policy_token_frac": 0.0})
    assert summarize_run(rows, N)["off_policy_token_frac"] == pytest.approx(0.125)

    rows = run_rows(30, 10, np.random.default_rng(2), off_policy=True, accuracy_end=0.5)
    run = summarize_run(rows, N)
    per_step = [r["rollout/off_policy_token_frac"] for r in rows]
    assert min(per_step) <= run["off_policy_token_frac"] <= max(per_step)
    assert 0.0 <= run["trained_off_policy_frac"] <= 1.0
    assert run["samples"] == 30 * GROUPS * N
    assert run["stale_restarts"] == 30 and run["dropped_tokens"] == 90
    assert run["eval_first"] == 0.0 and run["eval_last"] == pytest.approx(0.5)


def test_study_summary_spreads_over_seeds_and_compares_every_setting_with_sync_seed_by_seed():
    rng = np.random.default_rng(3)
    final = {"sync": [0.7, 0.8, 0.9], "april_s1": [0.75, 0.7, 0.95], "april_s4": [0.3, 0.5, 0.6]}
    runs = []
    for seed in range(3):
        for name, off_policy in (("sync", False), ("april_s1", True), ("april_s4", True)):
            rows = run_rows(30, 10, rng, off_policy=off_policy, accuracy_end=final[name][seed])
            runs.append(
                {
                    "setting": name,
                    "seed": seed,
                    "wall_s": rng.uniform(90, 150),
                    "cpu_s": rng.uniform(80, 140),
                    **summarize_run(rows, N),
                }
            )
    study = summarize_study(runs)
    assert list(study) == ["sync", "april_s1", "april_s4"]
    for name, entry in study.items():
        for key, value in entry.items():
            if isinstance(value, dict):
                assert value["min"] <= value["mean"] <= value["max"], (name, key)
        assert entry["eval_last_per_seed"] == pytest.approx(final[name])
        assert 0.0 <= entry["off_policy_token_frac"]["min"] <= entry["off_policy_token_frac"]["max"] <= 1.0
    assert study["sync"]["off_policy_token_frac"]["max"] == 0.0
    assert "learns_within_sync_spread" not in study["sync"]
    assert study["april_s1"]["eval_last_minus_sync_per_seed"] == pytest.approx([0.05, -0.1, 0.05])
    assert study["april_s1"]["learns_within_sync_spread"]  # mean 0.8 >= sync's lowest 0.7
    assert not study["april_s4"]["learns_within_sync_spread"]  # mean 0.47 < 0.7
