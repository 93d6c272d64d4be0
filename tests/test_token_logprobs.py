"""Log-probabilities and entropy made a chunk of positions at a time equal the plain [B, T, V] form,
values and gradients, and the train step's memory then no longer grows with T times the vocabulary."""

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from april_jax.models import qwen3, sharding
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer, token_logprobs
from benchmarks.train_step import step_temp_bytes
from tiny_models import TINY_QWEN3

ROOT = Path(__file__).resolve().parents[1]


def plain_logprobs(model, input_ids_BS, temperature, entropy_grad):
    """The reference, the form the chunks replace: every position's fp32 logits at once."""
    logits_BTV = model(input_ids_BS[:, :-1]).astype(jnp.float32) / temperature
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logits_BTV, input_ids_BS[:, 1:, None], axis=-1)[..., 0] - lse_BT
    if not entropy_grad:
        logits_BTV, lse_BT = jax.lax.stop_gradient(logits_BTV), jax.lax.stop_gradient(lse_BT)
    probs_BTV = jnp.exp(logits_BTV - lse_BT[..., None])
    return logp_BT, lse_BT - jnp.sum(probs_BTV * logits_BTV, axis=-1)


def values_and_grads(fn, model, ids_BS, weights):
    """(logp, entropy) and the gradient w.r.t. the params of sum(logp * w) + sum(entropy * w2)."""
    graphdef, state = nnx.split(model)

    def objective(state):
        logp_BT, entropy_BT = fn(nnx.merge(graphdef, state), ids_BS)
        return jnp.sum(logp_BT * weights[0]) + jnp.sum(entropy_BT * weights[1]), (logp_BT, entropy_BT)

    (_, outputs), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state)
    return outputs, grads


def flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("tied, entropy_grad", [(False, False), (False, True), (True, True)])
def test_chunked_equals_the_plain_form_in_values_and_gradients(tied, entropy_grad):
    cfg = TINY_QWEN3.replace(tie_word_embeddings=tied)
    B, S, temperature = 3, 40, 0.7  # T = 39: chunks of 8 are 5 chunks of 8 with one position of padding
    rng = np.random.default_rng(0)
    ids_BS = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, S)), jnp.int32)
    weights = [jnp.asarray(rng.normal(size=(B, S - 1)), jnp.float32) for _ in range(2)]
    # a model far from uniform, so the entropy and its gradient are not near their extremes
    model = qwen3.init_model(cfg.replace(initializer_range=0.2), seed=1)
    ref, g_ref = values_and_grads(
        lambda m, ids: plain_logprobs(m, ids, temperature, entropy_grad), model, ids_BS, weights
    )
    assert float(jnp.std(ref[1])) > 0.1
    # fp32 sums over the positions in another order: 1e-5 of the gradient's scale
    g_atol = 1e-5 * np.abs(flat(g_ref)).max()
    for chunk in (8, 13, 0):  # padded chunks, chunks that divide T, all at once (also T <= chunk)
        out, g = values_and_grads(
            partial(token_logprobs, temperature=temperature, entropy_grad=entropy_grad, chunk=chunk),
            model,
            ids_BS,
            weights,
        )
        for name, a, b in zip(("logp", "entropy"), out, ref):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=f"{name}, chunk {chunk}"
            )
        np.testing.assert_allclose(flat(g), flat(g_ref), atol=g_atol, rtol=1e-5, err_msg=f"chunk {chunk}")


def test_chunked_on_a_mesh_equals_the_plain_form():
    """Sharded params (vocab over `tensor`) and a batch over data x fsdp: the chunks keep both."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = qwen3.init_model(TINY_QWEN3.replace(initializer_range=0.2), seed=2, mesh=mesh)
    ids_BS = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 30)), jnp.int32)
    weights = [jnp.ones((4, 29), jnp.float32), jnp.full((4, 29), 0.5, jnp.float32)]
    ref, g_ref = values_and_grads(lambda m, ids: plain_logprobs(m, ids, 1.3, True), model, ids_BS, weights)
    out, g = values_and_grads(lambda m, ids: token_logprobs(m, ids, 1.3, True, chunk=8), model, ids_BS, weights)
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(flat(g), flat(g_ref), atol=1e-5 * np.abs(flat(g_ref)).max(), rtol=1e-5)


def test_train_step_temp_memory_at_16k_tokens_and_qwen3s_vocabulary_falls_4x():
    """One 16,384-token row at a vocabulary of 151,936: the plain step's fp32 logits alone are 10 GB.
    A model tiny but for its vocabulary compiles in seconds; nothing runs."""
    cfg = qwen3.Qwen3Config(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
    )
    S = 16_385
    batch = {
        "input_ids": np.random.default_rng(0).integers(0, cfg.vocab_size, (1, S)).astype(np.int32),
        "loss_mask": np.ones((1, S - 1), np.float32),
        "behaviour_logp": np.full((1, S - 1), -10.0, np.float32),
        "versions": np.zeros((1, S - 1), np.int32),
        "advantages": np.ones(1, np.float32),
    }
    trainer = Trainer(qwen3.init_model(cfg), LossConfig(), OptimizerConfig())
    chunked, plain = step_temp_bytes(trainer, batch, 1024), step_temp_bytes(trainer, batch, 0)
    print(f"temp bytes: chunked {chunked / 2**30:.2f} GiB, unchunked {plain / 2**30:.2f} GiB")
    assert plain > (S - 1) * cfg.vocab_size * 4  # at least one [T, V] fp32 array
    assert chunked * 4 <= plain, (chunked, plain)


@pytest.mark.slow
def test_train_step_benchmark_memory_only_prints_both_temp_sizes():
    """`benchmarks/train_step.py --memory-only` compiles the ~40M model's step twice and runs nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_step", "--batch", "1", "--seq", "600"]
        + ["--logprob-chunk", "128", "--memory-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "train_step_memory" and out["vocab"] == 32000 and out["logprob_chunk"] == 128
    assert 0 < out["temp_bytes"] < out["temp_bytes_unchunked"]
