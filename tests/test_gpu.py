"""GPU paths, run by `pytest -m gpu` on a CUDA machine (scripts/device_check.sh) and
skipped elsewhere with the reason: cuDNN flash attention vs the XLA path, a bf16 train step vs
fp32, the JAX engine's greedy tokens vs the model's own forward, sleep freeing the KV cache,
DLPack JAX -> torch zero-copy, the CUDA IPC transport into a torch process, and the host
transports fed from GPU parameters.

APRIL_JAX_GPU_TESTS_ON_CPU=1 runs on the CPU the tests that need no CUDA-only feature (the device
check's dry run does), so the test code has run before a GPU is lent for a few minutes. The last
test runs that dry run itself (not marked gpu: it is what CI can check).

Tolerances compare against an fp32 reference: a bf16 path must be about as close to it as the
other bf16 path is, rather than within a fixed figure.
"""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from april_jax.models import qwen3
from april_jax.models.hf import hf_name
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from april_jax.rollout.vllm import weights

ROOT = Path(__file__).resolve().parents[1]
ON_GPU = jax.default_backend() == "gpu" and torch.cuda.is_available()
CPU_TWIN = os.environ.get("APRIL_JAX_GPU_TESTS_ON_CPU") == "1"
WHY = (
    f"needs a CUDA GPU: JAX's backend is {jax.default_backend()!r}, "
    f"torch.cuda.is_available() is {torch.cuda.is_available()}"
)
gpu = pytest.mark.gpu
gpu_or_twin = pytest.mark.skipif(
    not (ON_GPU or CPU_TWIN), reason=WHY + " (APRIL_JAX_GPU_TESTS_ON_CPU=1 runs it on CPU)"
)
cuda_only = pytest.mark.skipif(not ON_GPU, reason=WHY + " (cuDNN, CUDA IPC or device memory: no CPU twin)")

# head_dim 64: cuDNN flash attention wants a multiple of 8, <= 256 on Hopper.
SMALL = qwen3.Qwen3Config(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
BF16 = jnp.bfloat16


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


CUDNN_FMHA = "fmha"  # in the custom-call targets of jax's cuDNN attention (__cudnn$fmhaSoftmax, ...Backward)


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def uses_cudnn_attention(model: qwen3.Qwen3, tokens_BT) -> bool:
    graphdef, state = nnx.split(model)
    return CUDNN_FMHA in lowered_text(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens_BT).lower()


def ragged_batch(lengths, S: int, seed: int) -> dict:
    """Right-padded rows of these lengths (pad 0); the loss covers every real next-token target."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    ids = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S - 1), np.float32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, SMALL.vocab_size, n)
        mask[b, : n - 1] = 1
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "behaviour_logp": np.full((B, S - 1), -7.0, np.float32),
        "versions": np.zeros((B, S - 1), np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


# ---------------------------------------------------------------- cuDNN flash attention


@gpu
@cuda_only
def test_cudnn_flash_attention_matches_xla_forward_and_gradient():
    B, T, H, K, D = 2, 255, 8, 2, 128  # odd T, as training's S - 1 positions are; GQA 4:1
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (B, T, n, D), jnp.float32) for kk, n in zip(keys, (H, K, K)))
    cotangent = jax.random.normal(keys[3], (B, T, H, D), jnp.float32)

    def run(implementation, dtype):
        def loss(q, k, v):
            out = qwen3._flash_causal_attention(q, k, v, dtype, implementation).astype(jnp.float32)
            return jnp.sum(out * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    ref, xla, cudnn = run("xla", jnp.float32), run("xla", BF16), run("cudnn", BF16)
    assert (
        CUDNN_FMHA
        in lowered_text(lambda q, k, v: qwen3._flash_causal_attention(q, k, v, BF16, "cudnn"), q, k, v).lower()
    )
    for name, r, x, c in zip(("out", "dq", "dk", "dv"), ref, xla, cudnn):
        assert rel_err(c, r) <= max(2 * rel_err(x, r), 1e-2), (name, rel_err(c, r), rel_err(x, r))


@pytest.fixture(scope="module")
def ragged():
    return ragged_batch([255, 200, 77, 13], S=256, seed=1)


@gpu
@cuda_only
def test_model_cudnn_attention_matches_xla_on_a_ragged_batch(ragged):
    """Logits at the real positions and the training loss's gradients, right-padded rows."""
    models = {
        name: qwen3.init_model(cfg, seed=2)
        for name, cfg in (
            ("ref", SMALL.replace(attention_impl="xla")),
            ("xla", SMALL.replace(dtype=BF16, attention_impl="xla")),
            ("cudnn", SMALL.replace(dtype=BF16, attention_impl="cudnn")),
            ("auto", SMALL.replace(dtype=BF16, attention_impl="auto")),
        )
    }
    tokens = jnp.asarray(ragged["input_ids"][:, :-1])
    assert uses_cudnn_attention(models["cudnn"], tokens) and uses_cudnn_attention(models["auto"], tokens)
    assert not uses_cudnn_attention(models["xla"], tokens)
    real = ragged["loss_mask"].astype(bool)
    logits = {n: np.asarray(m(tokens))[real] for n, m in models.items()}
    loss = LossConfig(pi_old="bypass")
    grads, losses = {}, {}
    for n, m in models.items():
        metrics, g = Trainer(m, loss, OptimizerConfig()).loss_and_grads(ragged, 0)
        grads[n], losses[n] = flat(g), float(metrics["train/loss"])
    for n in ("cudnn", "auto"):
        assert rel_err(logits[n], logits["ref"]) <= max(2 * rel_err(logits["xla"], logits["ref"]), 1e-2)
        assert rel_err(grads[n], grads["ref"]) <= max(2 * rel_err(grads["xla"], grads["ref"]), 2e-2)
        assert abs(losses[n] - losses["ref"]) <= max(2 * abs(losses["xla"] - losses["ref"]), 1e-3)


# ---------------------------------------------------------------- bf16 training


@gpu
@gpu_or_twin
def test_bf16_train_step_matches_fp32(ragged):
    """fp32 master weights, bf16 compute (cuDNN attention on a GPU) vs all-fp32: same loss,
    gradients, and first AdamW update direction."""
    fp32 = Trainer(qwen3.init_model(SMALL, seed=3), LossConfig(), OptimizerConfig(lr=1e-4))
    mixed = Trainer(qwen3.init_model(SMALL.replace(dtype=BF16), seed=3), LossConfig(), OptimizerConfig(lr=1e-4))
    (m32, g32), (m16, g16) = fp32.loss_and_grads(ragged, 0), mixed.loss_and_grads(ragged, 0)
    g32, g16 = flat(g32), flat(g16)
    assert abs(float(m16["train/loss"]) - float(m32["train/loss"])) <= 2e-2 * abs(float(m32["train/loss"])) + 1e-3
    assert cosine(g16, g32) > 0.99 and abs(np.linalg.norm(g16) / np.linalg.norm(g32) - 1) < 0.05
    before = flat(fp32.params)
    s32, s16 = fp32.step(ragged, 0), mixed.step(ragged, 0)
    assert s32["train/skipped"] == 0 and s16["train/skipped"] == 0
    d32, d16 = flat(fp32.params) - before, flat(mixed.params) - before
    assert flat(mixed.params).dtype == np.float32 and np.abs(d16).max() > 0
    assert cosine(d16, d32) > 0.9, cosine(d16, d32)


# ---------------------------------------------------------------- the JAX engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@gpu
@gpu_or_twin
def test_engine_greedy_tokens_match_the_models_forward(dtype):
    """Every greedy token is the forward's argmax up to a near-tie, and its logprob is the
    forward's; 6 requests through 4 slots (refills), ragged prompts."""
    model = qwen3.init_model(SMALL.replace(param_dtype=dtype, dtype=dtype), seed=4)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(1, SMALL.vocab_size, size=n).tolist() for n in (3, 17, 40, 9, 61, 28)]
    new = 24
    engine = JaxEngine(model, max_num_seqs=4, max_model_len=128)
    out = engine.generate([Request(str(i), p, new, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)])
    seqs = np.zeros((len(prompts), 128), np.int32)  # right-padded: causal, so padding changes nothing
    for i, p in enumerate(prompts):
        assert len(out[str(i)].token_ids) == new
        seqs[i, : len(p) + new] = p + out[str(i)].token_ids
    logits = np.asarray(model(jnp.asarray(seqs)), np.float64)
    tol = {"float32": 1e-2, "bfloat16": 0.1}[dtype]  # x the logits' spread
    exact = []
    for i, p in enumerate(prompts):
        rows = logits[i, len(p) - 1 : len(p) - 1 + new]
        tokens = np.array(out[str(i)].token_ids)
        chosen = rows[np.arange(new), tokens]
        scale = rows.std()
        assert np.all(rows.max(-1) - chosen <= tol * scale), (i, (rows.max(-1) - chosen) / scale)
        logp = chosen - np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) - rows.max(-1)
        np.testing.assert_allclose(out[str(i)].logprobs, logp, atol=tol * scale)
        exact.extend(tokens == rows.argmax(-1))
    assert np.mean(exact) >= 0.9


@gpu
@cuda_only
def test_engine_sleep_frees_the_kv_cache_on_gpu():
    model = qwen3.init_model(SMALL.replace(param_dtype=BF16, dtype=BF16), seed=5)
    engine = JaxEngine(model, max_num_seqs=32, max_model_len=2048)
    request = lambda tag: [Request(tag, [1, 2, 3], 8, SamplingParams(temperature=0.0))]
    first = engine.generate(request("a"))["a"].token_ids
    kv_bytes = engine.stats().kv_cache_bytes
    in_use = lambda: jax.devices()[0].memory_stats()["bytes_in_use"]
    awake = in_use()
    engine.sleep()
    asleep = in_use()
    engine.wake_up()
    assert kv_bytes > 50e6 and awake - asleep >= 0.9 * kv_bytes, (kv_bytes, awake, asleep)
    assert in_use() - asleep >= 0.9 * kv_bytes
    assert engine.generate(request("b"))["b"].token_ids == first


# ---------------------------------------------------------------- weight transports


def jax_pointer(array) -> int:
    if hasattr(array, "unsafe_buffer_pointer"):
        return array.unsafe_buffer_pointer()
    if hasattr(array, "__cuda_array_interface__"):
        return array.__cuda_array_interface__["data"][0]
    return array.addressable_data(0).unsafe_buffer_pointer()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@gpu
@gpu_or_twin
def test_dlpack_export_is_zero_copy(dtype):
    model = qwen3.init_model(SMALL.replace(param_dtype=dtype, dtype=dtype), seed=6)
    named = weights.named_torch(model)
    arrays = {hf_name(path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert named.keys() == arrays.keys() and len(named) > 10
    for name, t in named.items():
        assert t.device.type == ("cuda" if ON_GPU else "cpu"), name
        assert t.data_ptr() == jax_pointer(arrays[name]), name
        np.testing.assert_array_equal(t.float().cpu().numpy(), np.asarray(arrays[name], np.float32), err_msg=name)


@gpu
@cuda_only
def test_cuda_ipc_transport_reaches_a_torch_process():
    """CudaIpcBucket in this (JAX) process; a torch process maps the handle through the vLLM
    worker extension's code and hashes every tensor; two syncs, the second with other weights."""
    from benchmarks.cuda_ipc_receiver import ReceiverProcess, tensor_sha256

    models = [qwen3.init_model(SMALL, seed=s) for s in (7, 8)]
    bucket = weights.CudaIpcBucket(weights.named_torch(models[0]))
    receiver = ReceiverProcess(mode="hash")
    seen = []
    try:
        for model in models:
            named = weights.named_torch(model)
            bucket.write(named)
            answer = receiver.send(bucket.payload())
            expected = {name: tensor_sha256(t) for name, t in named.items()}
            assert answer["tensors"] == len(expected)
            assert answer["sha256"] == expected
            seen.append(expected)
    finally:
        receiver.close()
    assert seen[0] != seen[1]


@pytest.mark.parametrize("transport", ["shm", "file"])
@gpu
@gpu_or_twin
def test_host_transports_take_gpu_params(transport, tmp_path):
    """The default `shm` transport (and `file`) fed the trainer's parameters as they are on a GPU
    host: CUDA tensors from DLPack."""
    import safetensors.torch

    named = weights.named_torch(qwen3.init_model(SMALL, seed=9))
    path = tmp_path / "weights.safetensors"
    if transport == "shm":
        buffer = weights.SharedSafetensors(named, path)
        buffer.write(named)
        loaded = safetensors.torch.load_file(path)
        buffer.close()
    else:
        weights.write_safetensors(named, path)
        loaded = safetensors.torch.load_file(path)
    assert loaded.keys() == named.keys()
    for name, t in named.items():
        assert torch.equal(loaded[name], t.cpu()), name


# ---------------------------------------------------------------- the device check itself


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_device_check_dry_run_writes_its_summary(tmp_path):
    env = {**os.environ, "DEVICE_CHECK_BUDGET_S": "900"}
    # Its own process group: a timeout here ends the script's children too, not only bash.
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output = proc.communicate(timeout=900)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    log = (tmp_path / "device_check.log").read_text() if (tmp_path / "device_check.log").exists() else ""
    assert proc.returncode == 0, output[-3000:] + log[-5000:]
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert summary["mode"] == "dry-run" and summary["ok"]
    gpu_cases = summary["tests"]["gpu"]["cases"]
    assert len(gpu_cases) >= 10 and all(
        c["outcome"] == "skipped" and "needs a CUDA GPU" in c["message"] for c in gpu_cases
    )
    assert "cpu_twin" not in summary["tests"]  # DEVICE_CHECK_CPU_TWIN=1 adds it (+1.5 CPU-minutes)
    bench = summary["benchmarks"]
    assert {r["remat"] for r in bench["gpu_train_mfu"]} == {"none"} and all(
        r["mfu"] > 0 for r in bench["gpu_train_mfu"]
    )
    assert all(r["decode_tokens_per_s"] > 0 and r["roofline_tokens_per_s"] > 0 for r in bench["gpu_engine_decode"])
    (transfer,) = bench["gpu_weight_transfer"]
    assert transfer["zero_copy"] and transfer["cuda_ipc"].startswith("skipped")
    (update,) = bench["gpu_bf16_update"]
    assert update["mixed_update_cosine_vs_fp32"] > 0.9 and "bf16_changed_frac" in update
    assert all(goal["met"] is None for goal in summary["goals"].values())  # judged on a GPU only
    plan, run = bench["gpu_plan_run"]
    assert plan["part"] == "plan" and plan["fits"] and plan["rollout"]["engine"] == "jax"
    assert run["part"] == "colocated_run" and run["planned_peak_bytes"] > 0 and run["last_loss"] is not None
    assert summary["problems"]["items_skipped_on_purpose"] == ["gpu_april_smollm2"]
