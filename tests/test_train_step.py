"""The train step: micro-batching and sharding equal the plain step; GRPO learns; NaN steps are skipped."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from april_jax.data.types import PromptRecord
from april_jax.models import qwen3, sharding
from april_jax.rl.batch import groups_to_batch
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.jax_engine import JaxEngine
from tiny_models import TINY_QWEN3


def random_batch(B=8, S=12, seed=0, stale=True):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, (B, S)).astype(np.int32)
    mask = np.zeros((B, S - 1), np.float32)
    for b in range(B):
        start = rng.integers(1, 5)
        mask[b, start : start + rng.integers(2, S - start)] = 1
    versions = rng.integers(2, 5, (B, S - 1)).astype(np.int32) if stale else np.full((B, S - 1), 4, np.int32)
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "behaviour_logp": -rng.uniform(3.5, 4.5, (B, S - 1)).astype(np.float32),
        "versions": versions,
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


LOSS = LossConfig(loss_agg_mode="token-mean", kl_coef=0.0, max_staleness=1, staleness_decay=0.9)


def test_micro_batched_equals_full_batch():
    batch = random_batch()
    full = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3))
    micro = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    m_full, g_full = full.loss_and_grads(batch, 4)
    m_micro, g_micro = micro.loss_and_grads(batch, 4)
    np.testing.assert_allclose(float(m_micro["train/loss"]), float(m_full["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(flat(g_micro), flat(g_full), atol=1e-6, rtol=1e-4)
    assert np.abs(flat(g_full)).max() > 1e-4


@pytest.mark.slow
def test_sharded_step_equals_single_device():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    batch = random_batch(B=8)
    # with a KL term to a reference of other weights: the reference is sharded like the policy
    loss = dataclasses.replace(LOSS, kl_coef=0.1)
    ref = lambda m=None: qwen3.init_model(TINY_QWEN3, seed=9, mesh=m)
    single = Trainer(qwen3.init_model(TINY_QWEN3, seed=2), loss, OptimizerConfig(lr=1e-3), reference=ref())
    sharded = Trainer(
        qwen3.init_model(TINY_QWEN3, seed=2, mesh=mesh),
        loss,
        OptimizerConfig(lr=1e-3),
        mesh=mesh,
        micro_batch_size=4,
        reference=ref(mesh),
    )
    for r, p in zip(jax.tree.leaves(sharded.ref_params), jax.tree.leaves(sharded.params)):
        assert r.sharding == p.sharding
    up = sharded.params["layers"][0]["mlp"]["up_proj"]["weight"]
    assert up.sharding.spec == P("tensor", "fsdp")
    mu = sharded.opt_state[1][0].mu["layers"][0]["mlp"]["up_proj"]["weight"]
    assert mu.sharding.spec == P("tensor", "fsdp"), "Adam moments must be sharded like their params"
    assert mu.addressable_shards[0].data.shape == (32, 16)
    m1, g1 = single.loss_and_grads(batch, 4)
    m8, g8 = sharded.loss_and_grads(batch, 4)
    np.testing.assert_allclose(float(m8["train/loss"]), float(m1["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m8["train/kl"]), float(m1["train/kl"]), rtol=1e-5)
    assert float(m1["train/kl"]) > 0.01
    np.testing.assert_allclose(flat(g8), flat(g1), atol=1e-6, rtol=1e-4)
    # The 4B/8B configs train sharded with rematerialised layers: same loss and gradients.
    remat = Trainer(
        qwen3.init_model(TINY_QWEN3.replace(remat="full"), seed=2, mesh=mesh),
        loss,
        OptimizerConfig(lr=1e-3),
        mesh=mesh,
        micro_batch_size=4,
        reference=ref(mesh),
    )
    mr, gr = remat.loss_and_grads(batch, 4)
    np.testing.assert_allclose(float(mr["train/loss"]), float(m1["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(flat(gr), flat(g1), atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(remat.logprobs(batch["input_ids"])),  # pi_old, micro-batched
        np.asarray(single.logprobs(batch["input_ids"])),
        atol=1e-5,
    )
    s1, s8 = single.step(batch, 4), sharded.step(batch, 4)
    np.testing.assert_allclose(s8["train/grad_norm"], s1["train/grad_norm"], rtol=1e-5)
    assert sharded.params["layers"][0]["mlp"]["up_proj"]["weight"].sharding.spec == P("tensor", "fsdp")


def test_nan_step_is_skipped_and_counted():
    trainer = Trainer(qwen3.init_model(TINY_QWEN3, seed=3), LOSS, OptimizerConfig(lr=1e-2))
    before = flat(trainer.params)
    batch = random_batch()
    batch["advantages"][0] = np.nan
    metrics = trainer.step(batch, 4)
    assert metrics["train/skipped"] == 1 and trainer.skipped_steps == 1
    np.testing.assert_array_equal(flat(trainer.params), before)
    metrics = trainer.step(random_batch(), 4)
    assert metrics["train/skipped"] == 0 and trainer.skipped_steps == 1
    assert not np.array_equal(flat(trainer.params), before)


def test_grpo_raises_reward_on_a_tiny_task():
    """Reward = fraction of response tokens equal to 7; the random policy starts near 1/64."""
    model = qwen3.init_model(TINY_QWEN3, seed=4)
    rng = np.random.default_rng(0)
    prompts = (PromptRecord(f"p{i}", rng.integers(10, 64, 3).tolist()) for i in itertools.count())
    reward = lambda s, prompt: float(np.mean(np.asarray(s.response_ids) == 7))
    april = April(
        RolloutConfig(
            rollout_batch_size=4,
            n_samples_per_prompt=8,
            over_sampling_batch_size=6,
            max_response_len=4,
            temperature=1.0,
        ),
        prompts,
        reward,
    )
    engine = JaxEngine(model, max_num_seqs=32, max_model_len=16, seed=0)
    trainer = Trainer(model, LossConfig(), OptimizerConfig(lr=3e-2, max_grad_norm=1.0), micro_batch_size=16)
    rewards = []
    for version in range(14):
        groups, m = april.collect(engine, version)
        rewards.append(m["reward/mean"])
        batch = groups_to_batch(groups, pad_multiple=8)
        trainer.step(batch, version)
        engine.update_weights(trainer.nnx_state(), version + 1)
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.3, rewards


def masked_mean(x, mask):
    return float(np.where(mask > 0, x, 0).sum() / mask.sum())


def test_pi_old_is_fixed_per_rollout_batch_so_epoch_2_can_clip():
    """verl computes pi_old once per rollout batch: from the second PPO epoch on the ratio leaves 1
    and the clip binds. Recomputing it every epoch (what an unprepared `step` does) never clips."""
    batch = random_batch(seed=5, stale=False)
    trainer = Trainer(
        qwen3.init_model(TINY_QWEN3, seed=6),
        LossConfig(clip_eps_low=0.05, clip_eps_high=0.05, tis=None),
        OptimizerConfig(lr=3e-2),
    )
    before = np.asarray(trainer.logprobs(batch["input_ids"]))
    prepared = trainer.prepare(batch)
    np.testing.assert_array_equal(np.asarray(prepared["old_logp"]), before)
    epoch1 = trainer.step(prepared, 4)
    assert abs(epoch1["train/ppo_kl"]) < 1e-6 and epoch1["train/pg_clipfrac"] == 0  # pi == pi_old (to rounding)
    after1 = np.asarray(trainer.logprobs(batch["input_ids"]))
    ratio = np.exp(after1 - before)[batch["loss_mask"] > 0]
    assert np.abs(ratio - 1).max() > 0.05
    epoch2 = trainer.step(prepared, 4)
    np.testing.assert_array_equal(np.asarray(prepared["old_logp"]), before)  # untouched by the epochs
    np.testing.assert_allclose(epoch2["train/ppo_kl"], masked_mean(before - after1, batch["loss_mask"]), rtol=1e-4)
    r, A = np.exp(after1 - before), batch["advantages"][:, None]
    clipped = ((A > 0) & (r > 1.05)) | ((A < 0) & (r < 0.95))  # where PPO's min picks the clipped term
    np.testing.assert_allclose(epoch2["train/pg_clipfrac"], masked_mean(clipped, batch["loss_mask"]), atol=1e-6)
    assert epoch2["train/pg_clipfrac"] > 0
    # the path train.py takes: pi_old once, then num_iterations steps (metrics averaged over epochs)
    update = trainer.update(batch, 4, num_iterations=2)
    assert update["train/pg_clipfrac"] > 0 and abs(update["train/ppo_kl"]) > 1e-4
    # the bug this replaces: pi_old recomputed before each epoch keeps the ratio at exactly 1
    recomputed = [trainer.step(batch, 4) for _ in range(2)]
    assert all(m["train/pg_clipfrac"] == 0 and abs(m["train/ppo_kl"]) < 1e-6 for m in recomputed)


def test_one_epoch_takes_pi_old_from_its_own_forward_and_equals_a_recomputed_pi_old():
    """With one epoch pi_old is the params being differentiated: the step uses its own forward's
    logprobs instead of a separate pass, and the update equals one given the recomputed pi_old."""
    batch = random_batch(seed=7)
    loss = dataclasses.replace(LOSS, clip_eps_low=0.05, clip_eps_high=0.05)
    own, given = (Trainer(qwen3.init_model(TINY_QWEN3, seed=8), loss, OptimizerConfig(lr=3e-2)) for _ in range(2))
    initial = flat(own.params)
    m_own = own.update(batch, 4, num_iterations=1)
    assert not any(k[0] == "logprobs" for k in own._step_fns)  # no separate pi_old pass was compiled
    m_given = given.update({**batch, "old_logp": given.logprobs(batch["input_ids"])}, 4, num_iterations=1)
    assert m_own["train/ppo_kl"] == 0 and m_own["train/pg_clipfrac"] == 0
    for k in ("train/loss", "train/pg_loss", "train/is_ratio_mean", "train/tis_clipfrac", "train/grad_norm"):
        np.testing.assert_allclose(m_own[k], m_given[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # Adam's first step is ~lr x sign(g): a near-zero gradient's rounding moves its element by up to
    # ~1e-5 of a 3e-2 step
    np.testing.assert_allclose(flat(own.params), flat(given.params), rtol=1e-5, atol=2e-5)
    assert np.abs(flat(own.params) - initial).max() > 1e-3  # the update moved the params


def test_micro_batches_of_zero_advantage_are_skipped_and_the_update_is_the_same():
    batch = random_batch(B=8)
    batch["advantages"][[1, 2, 5, 6]] = 0.0  # two groups of equal rewards, interleaved with the rest
    full = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3))
    skipping = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    m_full, g_full = full.loss_and_grads(batch, 4)
    m_skip, g_skip = skipping.loss_and_grads(batch, 4)
    assert float(m_full["train/computed_rows_frac"]) == 1.0
    assert float(m_skip["train/computed_rows_frac"]) == 0.5  # 2 of 4 micro-batches computed
    np.testing.assert_allclose(float(m_skip["train/loss"]), float(m_full["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(flat(g_skip), flat(g_full), atol=1e-6, rtol=1e-4)
    assert np.abs(flat(g_full)).max() > 1e-4
    # The other metrics then cover the micro-batches computed: those of a batch of their rows alone.
    trained = {k: v[[0, 3, 4, 7]] for k, v in batch.items()}
    alone = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    m_rows, _ = alone.loss_and_grads(trained, 4)
    np.testing.assert_allclose(float(m_skip["train/entropy"]), float(m_rows["train/entropy"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_skip["train/ppo_kl"]), float(m_rows["train/ppo_kl"]), atol=1e-6)
    # A step on a batch of equal rewards only computes its first micro-batch (so that a diverged model
    # still shows in the loss) and moves nothing (Adam from zero state).
    idle = dict(batch, advantages=np.zeros(8, np.float32))
    before = flat(skipping.params)
    metrics = skipping.step(idle, 4)
    assert metrics["train/computed_rows_frac"] == 0.25 and metrics["train/grad_norm"] == 0.0
    np.testing.assert_array_equal(flat(skipping.params), before)
    broken = Trainer(qwen3.init_model(TINY_QWEN3, seed=1), LOSS, OptimizerConfig(lr=1e-3), micro_batch_size=2)
    broken.params = jax.tree.map(lambda x: x * np.float32(np.inf), broken.params)
    assert broken.step(idle, 4)["train/skipped"] == 1
