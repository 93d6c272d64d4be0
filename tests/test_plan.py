"""The deployment plan for the shipped GPU configs on the hardware they are written for, against
figures worked out by hand here from the published Qwen3 shapes; and `--plan` through the CLI,
which starts nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax.config.loading import load_config
from april_jax.training import devices as devices_lib
from april_jax.training.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("8xH100-80GB", "8xH200-141GB", "8xMI300X-192GB", "1xH100-80GB")
VERL_KV_TOKENS_H100 = 257_000  # verl's Qwen3-4B example: gpu_memory_utilization 0.6 on an H100


def qwen3_params(hidden, layers, inter, tied, vocab=151_936, heads=32, kv_heads=8, head_dim=128):
    """Parameters of a Qwen3 checkpoint, written out from its config.json fields."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden + 2 * head_dim  # q/k norms
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden  # two RMSNorms
    return layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)


P_4B = qwen3_params(2560, 36, 9728, tied=True)
P_8B = qwen3_params(4096, 36, 12288, tied=False)


def config(name, *overrides):
    return load_config(["train", "--config", str(ROOT / "configs" / name), *overrides])


def plan_of(name, spec, *overrides):
    return make_plan(config(name, *overrides), devices_lib.parse_spec(spec))


def near(value, expected, rel=0.05):
    return abs(value - expected) <= rel * expected


def test_published_parameter_counts():
    assert near(P_4B, 4.02e9, 0.01) and near(P_8B, 8.19e9, 0.01)


@pytest.mark.parametrize("spec", SPECS[:3])
def test_qwen3_4b_fits_every_gpu_serves(spec):
    plan = plan_of("qwen3_4b.py", spec)
    n = 8
    assert plan.fits, plan.problems
    tb = plan.trainer["bytes_per_device"]
    # fp32 master weights over fsdp=8: params 4 bytes, gradients 4, AdamW's two moments 8
    assert near(tb["parameters"], P_4B * 4 / n) and near(tb["gradients"], P_4B * 4 / n)
    assert near(tb["optimizer_state"], P_4B * 8 / n) and tb["reference"] == 0  # kl_coef 0
    # one 17,408-token row a device (micro-batch 8 over 8 devices), remat full: one bf16 residual a layer
    assert plan.trainer["rows_per_device"] == 1
    assert tb["activations"] >= 36 * 17_408 * 2560 * 2
    served = sorted(d for s in plan.servers for d in s.devices)
    assert served == list(range(n))  # every GPU serves rollout
    gpu_bytes = devices_lib.parse_spec(spec).bytes_per_device
    vendor_env = "HIP_VISIBLE_DEVICES" if spec.startswith("8xMI") else "CUDA_VISIBLE_DEVICES"
    for s in plan.servers:
        assert near(s.bytes_per_device["weights"], P_4B * 2 / s.tensor_parallel)  # bf16 weights
        assert s.kv_tokens == s.kv_cache_bytes * s.tensor_parallel // 147_456  # 2 x 36 x 8 x 128 x 2 bytes
        assert s.kv_tokens / s.tensor_parallel >= VERL_KV_TOKENS_H100
        assert "--enforce-eager" not in s.args and "--enable-prefix-caching" in s.args
        assert s.env == {vendor_env: ",".join(map(str, s.devices))}
        assert int(s.args[s.args.index("--kv-cache-memory-bytes") + 1]) == s.kv_cache_bytes
        assert s.args[s.args.index("--max-num-batched-tokens") + 1] == str(1024 + 16_384)
        # the trainer and the server side by side fit the GPU
        assert plan.trainer["peak_bytes_per_device"] + sum(s.bytes_per_device.values()) <= gpu_bytes
    fraction = float(plan.trainer["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    assert fraction + plan.servers[0].gpu_memory_utilization <= 1.0


def test_qwen3_4b_kv_grows_with_memory():
    tokens = [plan_of("qwen3_4b.py", spec).servers[0].kv_tokens for spec in SPECS[:3]]
    assert tokens[0] < tokens[1] < tokens[2]
    # the difference between two GPUs is their memory difference, all of it KV
    assert near((tokens[1] - tokens[0]) * 147_456, 61e9, 0.01)


def test_qwen3_8b_fits_8xh100():
    plan = plan_of("qwen3_8b.py", "8xH100-80GB")
    assert plan.fits, plan.problems
    tb = plan.trainer["bytes_per_device"]
    assert plan.trainer["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert near(tb["parameters"], P_8B * 4 / 8) and near(tb["optimizer_state"], P_8B * 8 / 8)
    assert sorted(d for s in plan.servers for d in s.devices) == list(range(8))


def test_disaggregated_splits_the_gpus():
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.deployment=disaggregated")
    assert plan.fits, plan.problems
    assert plan.trainer["devices"] == [0, 1, 2, 3] and plan.trainer["mesh"]["fsdp"] == 4
    assert sorted(d for s in plan.servers for d in s.devices) == [4, 5, 6, 7]
    # alone on its GPU a server takes far more KV than beside the trainer
    beside = plan_of("qwen3_4b.py", "8xH100-80GB").servers[0].kv_tokens
    assert plan.servers[0].kv_tokens > beside


def test_lora_trains_adapters_only():
    """Rank 16 on all seven projections of Qwen3-4B: 16 x (in + out) per projection per layer."""
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.model.lora_rank=16", "--config.loss.kl_coef=0.01")
    adapters = 36 * 16 * ((2560 + 4096) + 2 * (2560 + 1024) + (4096 + 2560) + 2 * (2560 + 9728) + (9728 + 2560))
    tb = plan.trainer["bytes_per_device"]
    assert near(tb["optimizer_state"], adapters * 8 / 8) and near(tb["gradients"], adapters * 4 / 8)
    assert near(tb["parameters"], (P_4B * 2 + adapters * 4) / 8)  # the base in bf16
    assert tb["reference"] == 0  # the base with the adapters off


def test_reference_model_counted_with_kl():
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.loss.kl_coef=0.01")
    assert near(plan.trainer["bytes_per_device"]["reference"], P_4B * 4 / 8)


def test_tensor_parallel_key():
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.tensor_parallel=2")
    assert [s.devices for s in plan.servers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(s.env == {"CUDA_VISIBLE_DEVICES": f"{s.devices[0]},{s.devices[1]}"} for s in plan.servers)
    bad = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.tensor_parallel=3")
    assert not bad.fits and "rollout.tensor_parallel=3" in bad.problems[0]


def test_jax_engine_slots_from_the_plan():
    """512 x 17,408 positions of Qwen3-4B KV would be 1.31 TB: the plan refuses, naming the key."""
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.engine=jax")
    assert not plan.fits
    assert any("rollout.max_num_seqs=512" in p for p in plan.problems), plan.problems
    slots = plan.rollout["jax_engine"]["slots_that_fit"]
    assert 0 < slots < 512
    ok = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.engine=jax", f"--config.rollout.max_num_seqs={slots}")
    assert ok.fits, ok.problems


def test_cpu_host_servers_each_on_their_own_cores():
    plan = plan_of(
        "tiny.py",
        "1xCPU-24GB",
        "--config.rollout.engine=vllm",
        "--config.rollout.servers=2",
    )
    assert plan.fits, plan.problems
    binds = [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in plan.servers]
    assert len(binds) == 2 and len(set(binds)) == 2
    assert all("--enforce-eager" in s.args for s in plan.servers)


@pytest.mark.parametrize("bad", ["8xH100", "H100-80GB", "8xT4-16GB", "0xH100-80GB", "2xCPU-24GB"])
def test_bad_device_spec_is_one_line(bad):
    with pytest.raises(devices_lib.DeviceSpecError, match="--plan-devices"):
        devices_lib.parse_spec(bad)


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "april_jax.train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_plan_cli_json_starts_nothing(tmp_path):
    """JAX_PLATFORMS=cuda on a machine without one: any backend start would fail the command."""
    workdir = tmp_path / "never"
    proc = cli(
        "--config",
        "configs/qwen3_4b.py",
        f"--config.workdir={workdir}",
        "--plan",
        "--plan-devices",
        "8xH200-141GB",
        "--json",
        env={"JAX_PLATFORMS": "cuda"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["fits"] is True and out["problems"] == []
    assert set(out["trainer"]["bytes_per_device"]) >= {"parameters", "gradients", "optimizer_state", "activations"}
    assert out["trainer"]["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    servers = out["rollout"]["servers"]
    assert out["rollout"]["engine"] == "vllm" and len(servers) == 8
    for s in servers:
        assert {"devices", "tensor_parallel", "kv_cache_bytes", "max_num_seqs", "argv", "env"} <= set(s)
    assert not workdir.exists()


def test_impossible_plan_is_one_error_line_exit_2():
    """Qwen3-8B with fp32 AdamW on one H100: the error names keys that would make it fit."""
    proc = cli("--config", "configs/qwen3_8b.py", "--plan", "--plan-devices", "1xH100-80GB", "--json")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: the deployment plan does not fit 1xH100-80GB"), errors
    assert "model.dtype=bfloat16" in errors[0] and "GB a device" in errors[0]
    assert json.loads(proc.stdout)["fits"] is False


def test_plan_table_and_bad_spec():
    proc = cli("--config", "configs/qwen3_4b.py", "--plan", "--plan-devices", "8xMI300X-192GB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "server7: GPUs 7, tensor parallel 1" in proc.stdout and "HIP_VISIBLE_DEVICES=7" in proc.stdout
    assert "CUDA_VISIBLE_DEVICES" not in proc.stdout and proc.stdout.strip().splitlines()[-1] == "fits"
    bad = cli("--config", "configs/qwen3_4b.py", "--plan", "--plan-devices", "8xV99-80GB")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "unknown device 'V99'" in lines[0], bad.stderr[-2000:]
