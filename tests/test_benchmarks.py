"""The benchmark scripts still run and print what RESULTS.md quotes (the cheap simulated engine)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_rollout_benchmark_on_the_sim_engine_prints_the_issue_keys(tmp_path):
    png = tmp_path / "busy.png"
    proc = subprocess.run([sys.executable, "rollout.py", "--engine", "sim", "--steps", "4", "--png", str(png)],
                          cwd=BENCH, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("sync_tokens_per_s", "april_tokens_per_s", "speedup", "limit_tokens_per_s", "april_fraction_of_limit",
                "sync_fraction_of_limit", "off_policy_token_frac", "dropped_tokens"):
        assert key in out, key
    # The seed's long tail leaves the synchronous baseline's slots idle; APRIL keeps them busy.
    assert out["speedup"] > 1.2 and out["april_occupancy"] > out["sync_occupancy"]
    assert out["april_tokens_per_s"] <= out["limit_tokens_per_s"]
    assert png.stat().st_size > 10_000


def test_engine_benchmark_runs_and_matches_transformers_greedy():
    proc = subprocess.run([sys.executable, "engine.py", "--batches", "2", "--new-tokens", "6", "--prompt-len", "5"],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float32"
    (row,) = out["results"]
    assert row["batch"] == 2 and row["greedy_identical_frac"] == 1.0
    assert row["jax_engine_tokens_per_s"] > 0 and row["hf_generate_tokens_per_s"] > 0
