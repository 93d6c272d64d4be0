"""The benchmark scripts still run and print what docs/performance.md quotes (the cheap simulated engine)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def rollout_json(*args):
    proc = subprocess.run([sys.executable, "rollout.py", "--engine", "sim", *args], cwd=BENCH, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rollout_benchmark_on_the_roofline_sim_prints_the_issue_keys(tmp_path):
    png = tmp_path / "busy.png"
    out = rollout_json("--cost", "h200-qwen3-4b", "--replicas", "8", "--steps", "4", "--png", str(png))
    for key in ("sync_tokens_per_s", "april_tokens_per_s", "speedup", "limit_tokens_per_s", "april_fraction_of_limit",
                "sync_fraction_of_limit", "off_policy_token_frac", "dropped_tokens", "cost", "kv_bytes_budget"):
        assert key in out, key
    for run in ("april", "sync"):
        for key in ("prefill_time_frac", "kv_bytes_peak", "on_policy_token_frac", "mean_loss_weight", "delivered_len_mean"):
            assert f"{run}_{key}" in out, (run, key)
        assert 0 < out[f"{run}_kv_bytes_peak"] <= out["kv_bytes_budget"]
    assert out["cost"]["name"] == "h200-qwen3-4b" and out["replicas"] == 8
    assert out["sync_on_policy_token_frac"] == 1.0 and out["sync_mean_loss_weight"] == 1.0
    assert out["april_tokens_per_s"] <= out["limit_tokens_per_s"] and out["sync_tokens_per_s"] <= out["sync_limit_tokens_per_s"]
    assert png.stat().st_size > 10_000


def test_rollout_benchmark_cpu_model_and_a_bad_preset():
    out = rollout_json("--cost", "cpu-jax", "--steps", "3")
    assert out["cost"]["name"] == "cpu-jax" and out["replicas"] == 1 and out["kv_bytes_budget"] is None
    proc = subprocess.run([sys.executable, "rollout.py", "--engine", "sim", "--cost", "a100"], cwd=BENCH,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--cost 'a100'" in proc.stderr and "Traceback" not in proc.stderr


def test_rollout_sweep_prints_a_row_per_seed_and_a_summary(tmp_path):
    proc = subprocess.run([sys.executable, "rollout_sweep.py", "--seeds", "0", "--steps", "2", "--sections", "parked_kv",
                           "--jobs", "1", "--markdown"], cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    per_seed = [r for r in rows if "summary" not in r]
    assert [r["row"] for r in per_seed] == ["parked KV off (re-prefill)"] and per_seed[0]["seed"] == 0
    assert per_seed[0]["april_kv_peak_frac"] <= 1 and per_seed[0]["sync_kv_peak_frac"] <= 1
    assert "| parked_kv | parked KV off (re-prefill) | 0 |" in proc.stdout
    # The per-task log on stderr rebuilds the same summary without running anything.
    log = tmp_path / "sweep.log"
    log.write_text(proc.stderr)
    again = subprocess.run([sys.executable, "rollout_sweep.py", "--seeds", "0", "--steps", "2", "--sections", "parked_kv",
                            "--from-log", str(log)], cwd=BENCH, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[0])["speedup"] == per_seed[0]["speedup"]


def test_engine_benchmark_runs_and_matches_transformers_greedy():
    proc = subprocess.run([sys.executable, "engine.py", "--batches", "2", "--new-tokens", "6", "--prompt-len", "5"],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float32"
    (row,) = out["results"]
    assert row["batch"] == 2 and row["greedy_identical_frac"] == 1.0
    assert row["jax_engine_tokens_per_s"] > 0 and row["hf_generate_tokens_per_s"] > 0


def test_april_vs_sync_summary_takes_the_compiles_out_of_the_steady_median():
    """Rollout seconds 1.0 / 0.2 / 2.5 / 0.3 / 0.4 after step 0, of which 0 / 0 / 2.2 / 0 / 0 compiling:
    the median is 0.4 with compiles, 0.3 without (hand-computed)."""
    sys.path.insert(0, str(BENCH))
    import april_vs_sync

    rollout, compile_s = [9.0, 1.0, 0.2, 2.5, 0.3, 0.4], [8.0, 0.0, 0.0, 2.2, 0.0, 0.0]
    rows = [{"step": i, "time/rollout_s": r, "time/rollout_compile_s": c, "time/train_s": 0.1, "time/elapsed_s": i + 1.0,
             "reward/mean": 0.5, "rollout/occupancy": 0.9, "rollout/response_len/mean": 8.0, "rollout/aborted": 0}
            for i, (r, c) in enumerate(zip(rollout, compile_s))]
    summary = april_vs_sync.summarize(rows, threshold=0.9)
    assert summary["median_rollout_s"] == 0.4
    assert abs(summary["median_rollout_steady_s"] - 0.3) < 1e-12
    assert summary["rollout_compile_s"] == 10.2
