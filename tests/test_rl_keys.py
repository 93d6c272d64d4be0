"""Keys that used to be dead or to say something else now do what they say: loss.norm_len,
optimizer.total_steps, rollout.max_staleness (the one staleness key; it also bounds how long a
vLLM server keeps its prefix cache), loss.kl_coef/loss.ref_path, reward/zero_std_groups and
rollout/tokens_per_s."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import config as config_lib
from april_jax.config import ConfigError
from april_jax.data.types import PromptRecord
from april_jax.models import hf, qwen3
from april_jax.rl.losses import LossConfig, policy_loss
from april_jax.rl.train_step import make_schedule
from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.sim_engine import SimEngine
from tiny_models import TINY_QWEN3


def config(**overrides):
    c = config_lib.default_config()
    for key, value in overrides.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


def test_norm_len_is_honoured_and_0_means_the_generation_budget():
    assert config_lib.loss_cfg(config(rollout__max_response_len=300)).norm_len == 300
    assert config_lib.loss_cfg(config(rollout__max_response_len=300, loss__norm_len=77)).norm_len == 77
    # ...and it is what seq-mean-token-sum-norm divides by
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.uniform(0.5, 2, (3, 6)), jnp.float32)
    args = dict(
        logp_BT=logp,
        old_logp_BT=logp,
        behaviour_logp_BT=logp,
        advantages_B=jnp.array([1.0, -0.5, 2.0]),
        mask_BT=jnp.ones((3, 6)),
        versions_BT=jnp.zeros((3, 6), jnp.int32),
        current_version=0,
    )
    loss = lambda n: float(policy_loss(LossConfig(loss_agg_mode="seq-mean-token-sum-norm", norm_len=n), **args)[0])
    np.testing.assert_allclose(loss(77), -(6 * (1.0 - 0.5 + 2.0)) / (3 * 77), rtol=1e-6)
    with pytest.raises(ConfigError, match="'loss.norm_len'=-1: must be >= 0"):
        config_lib.validate(config(loss__norm_len=-1, model__arch="tiny", data__task="reverse"))


def test_schedule_spans_the_run_unless_set():
    """One optimiser step per PPO epoch: 0 derives train.total_steps x train.num_iterations."""
    c = config(train__total_steps=40, train__num_iterations=3, optimizer__schedule="cosine", optimizer__lr=1.0)
    opt = config_lib.optimizer_cfg(c)
    assert opt.total_steps == 120
    lr = make_schedule(opt)
    assert float(lr(120)) == pytest.approx(0.0, abs=1e-6) and float(lr(60)) == pytest.approx(0.5, abs=0.02)
    c.optimizer.total_steps = 1000
    assert config_lib.optimizer_cfg(c).total_steps == 1000
    assert float(make_schedule(config_lib.optimizer_cfg(c))(120)) > 0.9  # the old default: barely decayed


def test_one_staleness_key_drives_rollout_and_loss():
    c = config(rollout__max_staleness=2)
    assert config_lib.loss_cfg(c).max_staleness == config_lib.rollout_cfg(c).max_staleness == 2
    assert "max_staleness" not in c.loss
    with pytest.raises(
        ConfigError, match="unknown config key 'loss.max_staleness'; did you mean --config.rollout.max_staleness"
    ):
        config_lib.check_overrides(["x", "--config.loss.max_staleness=3"])


def test_vllm_prefix_cache_lives_as_long_as_the_staleness_cap_only_where_resumes_happen():
    from april_jax.training.builders import kept_prefix_cache_versions

    assert kept_prefix_cache_versions(config()) == config_lib.default_config().rollout.max_staleness > 0
    assert kept_prefix_cache_versions(config(rollout__max_staleness=1)) == 1
    assert kept_prefix_cache_versions(config(rollout__partial_rollout=False)) == 0  # sync: nothing resumes
    assert kept_prefix_cache_versions(config(rollout__hold_aborted_kv=False)) == 0
    assert kept_prefix_cache_versions(config(rollout__vllm_sleep_mode=True)) == 0  # a sleeping server drops its KV


def test_kl_reference_from_ref_path_or_saved_after_warmup(tmp_path):
    from april_jax.training.builders import build_reference

    policy, other = qwen3.init_model(TINY_QWEN3, seed=0), qwen3.init_model(TINY_QWEN3, seed=1)
    weight = lambda m: np.asarray(m.embed_tokens[...])
    assert build_reference(config(loss__kl_coef=0.0, loss__ref_path="x"), None, policy, tmp_path, True) is None
    hf.save_pretrained(other, tmp_path / "ref")
    ref = build_reference(config(loss__kl_coef=0.1, loss__ref_path=str(tmp_path / "ref")), None, policy, tmp_path, True)
    np.testing.assert_array_equal(weight(ref), weight(other))
    # after a warm-up the initial policy is saved on the fresh run and loaded on resume
    c = config(loss__kl_coef=0.1, warmup__steps=5)
    assert build_reference(c, None, policy, tmp_path, fresh=True) is None  # the Trainer copies the params
    np.testing.assert_array_equal(weight(build_reference(c, None, other, tmp_path, fresh=False)), weight(policy))


def prompts():
    rng = np.random.default_rng(0)
    for i in itertools.count():
        yield PromptRecord(f"p{i}", rng.integers(1, 500, 8).tolist())


def test_zero_std_groups_counted_without_dynamic_sampling():
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, over_sampling_batch_size=6, max_response_len=300)
    reward = lambda s, prompt: float(len(s.response_ids) % 2)  # equal within about half the groups
    april, engine = April(cfg, prompts(), reward), SimEngine(slots=16, seed=1, length_scale=1 / 64)
    counted, expected = 0, 0
    for version in range(6):
        groups, m = april.collect(engine, version)
        engine.update_weights(None, version + 1)
        counted += m["reward/zero_std_groups"]
        expected += sum(len({s.reward for s in g.samples}) == 1 for g in groups)
    assert counted == expected > 0


def test_tokens_per_s_counts_what_the_engine_generated_in_the_step():
    """Responses truncated at a short budget finish together, so the surplus complete groups serve
    the next steps from the buffer: those generate nothing and report 0 tokens/s (not delivered
    tokens over ~0 s); the others report the engine's new tokens over the step's engine time."""
    cfg = RolloutConfig(
        rollout_batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_batch_size=4,
        max_response_len=8,
        refill="groups",
        inflight="over_sampling",
    )  # surplus groups: the paper's over-sampling
    april, engine = April(cfg, prompts(), lambda s, p: 1.0), SimEngine(slots=16, seed=1, length_scale=1.0)
    rows = []
    for version in range(4):
        before = engine.stats().tokens_generated
        groups, m = april.collect(engine, version)
        rows.append((engine.stats().tokens_generated - before, m))
    for generated, m in rows:
        assert m["rollout/generated_tokens"] == generated
        expected = generated / m["rollout/time_s"] if generated else 0.0
        assert m["rollout/tokens_per_s"] == pytest.approx(expected)
    from_buffer = [m for generated, m in rows if generated == 0]
    assert from_buffer and all(m["rollout/tokens"] > 0 and m["rollout/tokens_per_s"] == 0 for m in from_buffer)
    assert rows[0][0] > rows[0][1]["rollout/tokens"], "step 0 generated more than it delivered"
