"""The benchmark scripts still run and print what docs/performance.md quotes (the cheap simulated engine)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]


def benchmark(name: str, *args) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


def rollout_json(*args):
    proc = subprocess.run(
        benchmark("rollout", "--engine", "sim", *args), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rollout_benchmark_on_the_roofline_sim_runs_the_product_defaults_and_reports_end_to_end(tmp_path):
    png = tmp_path / "busy.png"
    out = rollout_json("--cost", "h200-qwen3-4b", "--replicas", "8", "--steps", "4", "--png", str(png))
    default = RolloutConfig()
    for key in ("max_staleness", "refill", "inflight", "finish_wait", "inflight_headroom", "stale_policy"):
        assert out[key] == getattr(default, key), key  # APRIL as shipped: no benchmark-only design
    assert out["over_sampling"] == default.over_sampling_batch_size
    for key in (
        "sync_tokens_per_s",
        "april_tokens_per_s",
        "rollout_speedup",
        "e2e_speedup",
        "free_limit_tokens_per_s",
        "april_fraction_of_free_limit",
        "dropped_tokens",
        "cost",
        "kv_bytes_budget",
        "gpus",
    ):
        assert key in out, key
    for run in ("april", "sync"):
        for key in (
            "prefill_time_frac",
            "kv_bytes_peak",
            "on_policy_token_frac",
            "mean_loss_weight",
            "delivered_len_mean",
            "e2e_steps_per_s",
            "train_time_frac",
        ):
            assert f"{run}_{key}" in out, (run, key)
        assert 0 < out[f"{run}_kv_bytes_peak"] <= out["kv_bytes_budget"]
        assert 0 < out[f"{run}_train_time_frac"] < 1
    assert out["cost"]["name"] == "h200-qwen3-4b" and out["replicas"] == 8
    assert out["deployment"] == "colocated" and out["gpus"] == 8 and out["april_kv_reused"] == 0
    assert out["sync_on_policy_token_frac"] == 1.0 and out["sync_mean_loss_weight"] == 1.0
    assert out["april_tokens_per_s"] <= out["free_limit_tokens_per_s"]
    assert abs(out["e2e_speedup"] - out["april_e2e_steps_per_s"] / out["sync_e2e_steps_per_s"]) < 0.002
    # training is the same for both, so end to end gains less than the rollout alone
    assert 1 < out["e2e_speedup"] < out["rollout_speedup"]
    assert png.stat().st_size > 10_000
    apart = rollout_json("--cost", "h200-qwen3-4b", "--replicas", "8", "--steps", "4", "--deployment", "disaggregated")
    assert apart["gpus"] == 16 and apart["train_gpus"] == 8 and apart["april_kv_reused"] > 0
    assert apart["april_prefill_time_frac"] < out["april_prefill_time_frac"]


def test_rollout_benchmark_simulates_the_deployment_plan_of_a_config():
    """--config/--plan-devices: one replica per planned server at its tensor parallel, KV tokens and
    max_num_seqs (read back from the JSON against the plan itself); the plan's sleep level 0 keeps the
    servers' KV through the update (resumes reuse it), while its time-shared layout (sleep level 1,
    here by train.offload=on) sleeps and re-prefills."""
    from april_jax.config.loading import load_config
    from april_jax.training.devices import parse_spec
    from april_jax.training.plan import make_plan

    config = ["--config", "configs/qwen3_4b.py", "--config.rollout.tensor_parallel=2"]
    plan = make_plan(load_config(["prog", *config]), parse_spec("8xH200-141GB"))
    server = plan.servers[0]
    out = rollout_json(*config, "--plan-devices", "8xH200-141GB", "--steps", "2")
    summary = out["plan"]
    assert (summary["servers"], summary["tensor_parallel"]) == (len(plan.servers), 2) == (4, 2)
    assert summary["kv_tokens_per_server"] == server.kv_tokens == out["cost"]["kv_budget_tokens"]
    assert summary["max_num_seqs"] == server.max_num_seqs == out["slots"] == 512
    assert (summary["sleep_level"], summary["deployment"], summary["devices"]) == (
        0,
        "colocated",
        plan.devices.describe(),
    )
    assert out["replicas"] == 4 and out["cost"]["tensor_parallel"] == 2 and out["gpus"] == out["train_gpus"] == 8
    assert out["max_response_len"] == 16384 and out["over_sampling"] == 64 and out["max_staleness"] == 4
    assert out["engine_sleeps"] is False and out["april_kv_reused"] > 0
    asleep = rollout_json(
        "--config", "configs/qwen3_4b.py", "--config.train.offload=on", "--plan-devices", "8xH200-141GB", "--steps", "2"
    )
    assert asleep["plan"]["sleep_level"] == 1 and asleep["engine_sleeps"] is True and asleep["april_kv_reused"] == 0
    kept = rollout_json("--config", "configs/qwen3_4b.py", "--plan-devices", "8xH200-141GB", "--steps", "2")
    assert kept["plan"]["sleep_level"] == 0 and kept["april_kv_reused"] > 0
    assert kept["april_prefill_tokens_per_response_token"] < asleep["april_prefill_tokens_per_response_token"]


def test_end_to_end_accounting_by_hand():
    """A rollout of 100 s over two steps that train 10 s each: 120 s end to end, 1/60 step/s and, for
    1200 delivered tokens, 10 tokens/s."""
    from benchmarks import rollout

    e2e = rollout.end_to_end(100.0, [10.0, 10.0], 1200)
    assert e2e == {"e2e_time_s": 120.0, "e2e_steps_per_s": 2 / 120, "e2e_tokens_per_s": 10.0, "train_time_s": 20.0}


def test_rollout_benchmark_cpu_model_and_a_bad_preset():
    out = rollout_json("--cost", "cpu-jax", "--steps", "3")
    assert out["cost"]["name"] == "cpu-jax" and out["replicas"] == 1 and out["kv_bytes_budget"] is None
    assert out["april_train_time_frac"] == 0  # training not modelled on the CPU model
    for bad, says in (
        (["--cost", "a100"], "--cost 'a100'"),
        (["--train-gpus", "4"], "--train-gpus 4"),
        (["--deployment", "shared"], "--deployment"),
        (["--config", "configs/qwen3_4b.py"], "--plan-devices"),
        (["--config", "configs/qwen3_4b.py", "--plan-devices", "8xH200-141GB", "--slots", "64"], "--slots"),
        (["--config", "configs/qwen3_4b.py", "--plan-devices", "8xA100-80GB"], "A100"),
    ):
        proc = subprocess.run(
            benchmark("rollout", "--engine", "sim", *bad), cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_rollout_sweep_prints_a_row_per_seed_and_a_summary(tmp_path):
    proc = subprocess.run(
        benchmark(
            "rollout_sweep", "--seeds", "0", "--steps", "2", "--sections", "deployment", "--jobs", "1", "--markdown"
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    per_seed = [r for r in rows if "summary" not in r]
    assert [r["row"] for r in per_seed] == ["disaggregated (KV kept across the train step)"] and per_seed[0][
        "seed"
    ] == 0
    assert per_seed[0]["april_kv_peak_frac"] <= 1 and per_seed[0]["sync_kv_peak_frac"] <= 1
    assert "| deployment | disaggregated (KV kept across the train step) | 0 |" in proc.stdout
    # The per-task log on stderr rebuilds the same summary without running anything.
    log = tmp_path / "sweep.log"
    log.write_text(proc.stderr)
    again = subprocess.run(
        benchmark("rollout_sweep", "--seeds", "0", "--steps", "2", "--sections", "deployment", "--from-log", str(log)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[0])["speedup"] == per_seed[0]["speedup"]


@pytest.mark.slow
def test_engine_benchmark_runs_and_matches_transformers_greedy():
    proc = subprocess.run(
        benchmark("engine", "--batches", "2", "--new-tokens", "6", "--prompt-len", "5"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float32"
    (row,) = out["results"]
    assert row["batch"] == 2 and row["greedy_identical_frac"] == 1.0
    assert row["jax_engine_tokens_per_s"] > 0 and row["hf_generate_tokens_per_s"] > 0


def april_vs_sync_rows(rollout, compile_s, eval_first=0.3, eval_last=0.5):
    """metrics.jsonl rows of a finished run (the keys `april_vs_sync.summarize` reads)."""
    rows = [
        {
            "step": i,
            "time/rollout_s": r,
            "time/rollout_compile_s": c,
            "time/train_s": 0.1,
            "time/elapsed_s": i + 1.0,
            "reward/mean": 0.5,
            "rollout/occupancy": 0.9,
            "rollout/response_len/mean": 8.0,
            "rollout/aborted": 0,
        }
        for i, (r, c) in enumerate(zip(rollout, compile_s))
    ]
    rows[0].update({"eval/accuracy": eval_first, "eval/version": 0})
    rows[-1].update({"eval/accuracy": eval_last, "eval/version": len(rows)})
    return rows


def test_april_vs_sync_summary_takes_the_compiles_out_of_the_steady_median():
    """Rollout seconds 1.0 / 0.2 / 2.5 / 0.3 / 0.4 after step 0, of which 0 / 0 / 2.2 / 0 / 0 compiling:
    the median is 0.4 with compiles, 0.3 without (hand-computed)."""
    from benchmarks import april_vs_sync

    rows = april_vs_sync_rows([9.0, 1.0, 0.2, 2.5, 0.3, 0.4], [8.0, 0.0, 0.0, 2.2, 0.0, 0.0])
    summary = april_vs_sync.summarize(rows, threshold=0.9)
    assert summary["median_rollout_s"] == 0.4
    assert abs(summary["median_rollout_steady_s"] - 0.3) < 1e-12
    assert summary["rollout_compile_s"] == 10.2


def test_april_vs_sync_compares_only_the_seeds_that_have_both_modes(tmp_path, monkeypatch, capsys):
    """Runs trained by earlier invocations (`--modes` trains none here): seed 0 has both modes, seed
    1 only APRIL. Seed 1 is reported alone, not an error, and the comparison is over seed 0."""
    from benchmarks import april_vs_sync

    for mode, seed, last in (("april", 0, 0.5), ("sync", 0, 0.6), ("april", 1, 0.4)):
        workdir = tmp_path / f"{mode}_seed{seed}"
        workdir.mkdir()
        rows = april_vs_sync_rows([9.0, 1.0, 2.0], [8.0, 0.0, 0.0], eval_last=last)
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (workdir / "benchmark_run.json").write_text(json.dumps({"wall_s": 3.0, "cpu_s": 2.0}))
    argv = [
        "april_vs_sync",
        "--config",
        str(ROOT / "configs/tiny.py"),
        "--seeds",
        "0,1",
        "--modes",
        "",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    april_vs_sync.main()
    out, err = capsys.readouterr()
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{") and line.endswith("}")]
    assert [(r["mode"], r["seed"], r["eval_last"]) for r in runs] == [
        ("april", 0, 0.5),
        ("sync", 0, 0.6),
        ("april", 1, 0.4),
    ]
    overall = json.loads(out[out.index("{\n") :])
    assert overall["seeds"] == [0] and overall["eval_last"]["april"]["mean"] == 0.5
    assert "no finished sync run" in err and "seed 1 is not compared" in err
    assert (tmp_path / "april_vs_sync.png").exists()


def test_april_vs_sync_seconds_to_reward_in_a_run_shorter_than_the_moving_window():
    """3 steps (under the 10-step window): the mean of all 3 rewards, (0.2 + 1 + 1) / 3 = 0.733,
    reaches 0.7 at the last step (elapsed 3.0 s)."""
    from benchmarks import april_vs_sync

    rows = april_vs_sync_rows([9.0, 1.0, 2.0], [8.0, 0.0, 0.0])
    for row, reward in zip(rows, (0.2, 1.0, 1.0)):
        row["reward/mean"] = reward
    summary = april_vs_sync.summarize(rows, threshold=0.7)
    assert (summary["steps_to_reward"], summary["seconds_to_reward"]) == (2, 3.0)
    assert april_vs_sync.summarize(rows, threshold=0.8)["seconds_to_reward"] is None


def last_json(name: str, *args):
    proc = subprocess.run(benchmark(name, *args), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_train_step_benchmark_reports_optimizer_state_and_compares_lora_with_full():
    small = ["--batch", "2", "--seq", "66", "--micro", "2", "--steps", "1", "--vocab", "256"]
    full = last_json("train_step", *small)
    assert full["lora_rank"] == 0 and full["step_s"] > 0
    assert full["optimizer_state_bytes"] >= 2 * 4 * full["trainable_params"]  # AdamW's two fp32 moments
    both = last_json("train_step", *small, "--compare-lora", "4")
    assert both["full"]["optimizer_state_bytes"] == full["optimizer_state_bytes"]
    assert 0 < both["lora"]["trainable_params"] < both["full"]["trainable_params"] / 20
    ratio = both["lora"]["optimizer_state_bytes"] / both["full"]["optimizer_state_bytes"]
    assert both["optimizer_state_ratio"] == round(ratio, 4) and both["goals"]["optimizer_state_ratio<=0.05"]
    assert both["step_s_ratio"] == round(both["lora"]["step_s"] / both["full"]["step_s"], 3)


def test_weight_sync_benchmark_prints_the_lora_sync_merged_and_adapters_only():
    out = last_json("weight_sync", "--repeats", "1", "--lora-rank", "4")
    lora = out["lora"]
    assert lora["merged_sync"]["bytes"] == out["bytes"], "merged: what full fine-tuning sends"
    assert 0 < lora["adapters_only"]["bytes"] < out["bytes"] / 50
    assert "not built" in lora["adapters_only"]["vllm_adapter_sync"]
