"""KL to a frozen reference: the loss term against a plain-numpy transcription of verl's
kl_penalty (value and gradient, k1/k2/k3, the k3 clamps at extreme inputs), and the trainer's
reference (initial params or a given model) changing the update by exactly kl_coef x the numpy
gradient pulled back through the model. The sharded reference: tests/test_train_step.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import qwen3
from april_jax.rl.losses import LossConfig, policy_loss
from april_jax.rl.train_step import OptimizerConfig, Trainer, token_logprobs
from tiny_models import TINY_QWEN3

KINDS = ("k1", "k2", "k3")


# ---------------- verl's kl_penalty (verl/trainer/ppo/core_algos.py), transcribed to numpy ----------------


def verl_kl(logprob, ref_logprob, kind):
    if kind == "k1":  # "kl"
        return logprob - ref_logprob
    if kind == "k2":  # "mse"
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = np.clip(ref_logprob - logprob, -20, 20)  # "low_var_kl"
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def verl_kl_grad(logprob, ref_logprob, kind):
    """d verl_kl / d logprob, by hand (a clamp passes no gradient where it binds)."""
    if kind == "k1":
        return np.ones_like(logprob)
    if kind == "k2":
        return logprob - ref_logprob
    raw = ref_logprob - logprob
    kl = np.clip(raw, -20, 20)
    kld = np.exp(kl) - kl - 1
    return -(np.exp(kl) - 1) * (np.abs(raw) < 20) * (kld < 10)


def token_mean(x, mask):
    return np.where(mask > 0, x, 0.0).sum() / max(mask.sum(), 1)


# ---------------- the loss term ----------------


def kl_term(kind, logp, ref, mask, coef=0.5):
    """Our loss with kl_coef minus the same loss without it: exactly kl_coef x agg(kl)."""
    B, T = logp.shape
    args = dict(
        old_logp_BT=jnp.asarray(logp, jnp.float32),
        behaviour_logp_BT=jnp.asarray(logp, jnp.float32),
        advantages_B=jnp.zeros(B),
        mask_BT=jnp.asarray(mask),
        versions_BT=jnp.zeros((B, T), jnp.int32),
        current_version=0,
        ref_logp_BT=jnp.asarray(ref, jnp.float32),
    )
    cfg = LossConfig(kl_coef=coef, kl_type=kind, tis=None)

    def f(lp):
        loss, metrics = policy_loss(cfg, logp_BT=lp, **args)
        return loss, metrics["train/kl"]

    (loss, kl), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp, jnp.float32))
    return float(loss), float(kl), np.asarray(grad)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_value_and_gradient_match_verl(kind):
    rng = np.random.default_rng(0)
    ref = -rng.uniform(0.1, 4.0, (4, 9))
    logp = ref + rng.normal(0, 1.5, ref.shape)  # k3 reaches its upper clamp (10) at a few of these
    mask = (np.arange(9)[None] < np.array([9, 5, 1, 7])[:, None]).astype(np.float32)
    loss, kl, grad = kl_term(kind, logp, ref, mask, coef=0.5)
    expected = token_mean(verl_kl(logp, ref, kind), mask)
    np.testing.assert_allclose(kl, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.5 * expected, rtol=1e-5)
    np.testing.assert_allclose(
        grad, 0.5 * np.where(mask > 0, verl_kl_grad(logp, ref, kind), 0) / mask.sum(), rtol=1e-4, atol=1e-7
    )
    if kind == "k3":
        assert (verl_kl(logp, ref, kind)[mask > 0] == 10).any(), "the case should exercise the clamp"


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_inputs_give_finite_gradients(kind):
    """Padding with logp = -1e4 (masked) and unmasked differences of +-50 and +-1e4: verl's clamps
    keep k3 at most 10 with no gradient there, and masked positions give exactly 0, never NaN."""
    logp = np.array([[-1.0, -50.0, -0.5, -1e4, -1e4], [-60.0, -2.0, -1e4, -3.0, -1e4]])
    ref = np.array([[-1.2, -0.1, -60.0, 0.0, 0.0], [-0.2, -2.5, -1.0, -3.0, 0.0]])
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    loss, kl, grad = kl_term(kind, logp, ref, mask, coef=1.0)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert np.all(grad[mask == 0] == 0)
    np.testing.assert_allclose(kl, token_mean(verl_kl(logp, ref, kind), mask), rtol=1e-5)
    np.testing.assert_allclose(
        grad, np.where(mask > 0, verl_kl_grad(logp, ref, kind), 0) / mask.sum(), rtol=1e-4, atol=1e-7
    )


# ---------------- the trainer's reference ----------------


def batch(B=4, S=10, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S - 1), np.float32)
    mask[:, 3:] = 1
    mask[1, 6:] = 0  # one shorter response: padding inside the batch
    return {
        "input_ids": rng.integers(0, 64, (B, S)).astype(np.int32),
        "loss_mask": mask,
        "behaviour_logp": np.full((B, S - 1), -4.0, np.float32),
        "versions": np.zeros((B, S - 1), np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_kl_changes_the_gradient_by_the_numpy_prediction():
    """grad(kl_coef) - grad(0) = kl_coef x J^T dKL/dlogp, with dKL/dlogp from the numpy transcription
    at the policy's and the reference's logprobs, and J^T pulled back through the model by jax.vjp.
    (k3, the kind with clamps; the three kinds' term is checked against numpy above.)"""
    coef, b, kind = 0.3, batch(), "k3"
    reference = qwen3.init_model(TINY_QWEN3, seed=11)  # a different policy, so that the KL is far from 0
    with_kl = Trainer(
        qwen3.init_model(TINY_QWEN3, seed=10),
        LossConfig(kl_coef=coef, kl_type=kind),
        OptimizerConfig(),
        reference=reference,
        micro_batch_size=2,
    )
    without = Trainer(qwen3.init_model(TINY_QWEN3, seed=10), LossConfig(kl_coef=0.0), OptimizerConfig())
    assert without.ref_params is None, "no reference is kept when kl_coef == 0"
    m_kl, g_kl = with_kl.loss_and_grads(b, 0)
    m_0, g_0 = without.loss_and_grads(b, 0)
    assert "train/kl" not in m_0

    logp = np.asarray(with_kl.logprobs(b["input_ids"]), np.float64)
    ref = np.asarray(with_kl.logprobs(b["input_ids"], with_kl.ref_params), np.float64)
    np.testing.assert_allclose(float(m_kl["train/kl"]), token_mean(verl_kl(logp, ref, kind), b["loss_mask"]), rtol=1e-4)
    dkl_dlogp = np.where(b["loss_mask"] > 0, verl_kl_grad(logp, ref, kind), 0) / b["loss_mask"].sum()
    pull_back = jax.jit(lambda p, v: jax.vjp(lambda q: token_logprobs(with_kl.model(q), b["input_ids"])[0], p)[1](v)[0])
    predicted = pull_back(with_kl.params, jnp.asarray(coef * dkl_dlogp, jnp.float32))
    np.testing.assert_allclose(flat(g_kl) - flat(g_0), flat(predicted), atol=2e-6, rtol=1e-3)
    assert np.abs(flat(predicted)).max() > 1e-3


def test_reference_is_the_frozen_initial_policy_and_kl_pulls_back_to_it():
    """With zero advantages only the KL moves the policy: away from the reference it cannot
    go, so after the first update the KL to the initial params stays small; with kl_coef = 0
    nothing moves at all."""
    b = dict(batch(seed=1), advantages=np.zeros(4, np.float32))
    model = qwen3.init_model(TINY_QWEN3, seed=12)
    trainer = Trainer(model, LossConfig(kl_coef=1.0, kl_type="k3"), OptimizerConfig(lr=1e-2))
    initial = flat(trainer.params)
    np.testing.assert_array_equal(flat(trainer.ref_params), initial)
    # push the policy off the reference with policy-gradient epochs, then let the KL act alone
    trainer.update(dict(b, advantages=np.array([3.0, -3.0, 3.0, -3.0], np.float32)), 0, num_iterations=3)
    np.testing.assert_array_equal(flat(trainer.ref_params), initial)  # frozen (not donated with the params)
    kls = [trainer.update(b, 0)["train/kl"] for _ in range(4)]
    assert kls[0] > 0 and kls[-1] < 0.5 * kls[0], kls
    with pytest.raises(ValueError, match="loss.ref_path"):
        Trainer(
            qwen3.init_model(TINY_QWEN3, seed=12),
            LossConfig(kl_coef=1.0),
            OptimizerConfig(),
            reference=qwen3.init_model(TINY_QWEN3.replace(head_dim=16), seed=0),
        )
