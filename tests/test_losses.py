"""Losses and advantages against plain-numpy transcriptions of the published formulas."""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.rl.advantages import group_advantages, overlong_penalty
from april_jax.rl.losses import AGG_MODES, LossConfig, policy_loss

jax.config.update("jax_enable_x64", False)
B, T = 5, 7


# ---------------- numpy reference (float64) ----------------


def np_agg(x, mask, mode, norm_len):
    x = np.where(mask, x, 0.0)
    seqs = max((mask.sum(-1) > 0).sum(), 1)
    if mode == "token-mean":
        return x.sum() / max(mask.sum(), 1)
    if mode == "seq-mean-token-sum":
        return x.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / np.maximum(mask.sum(-1), 1)).sum() / seqs
    return x.sum() / (seqs * norm_len)


def np_loss(cfg, logp, old, behav, adv, mask, versions, cur, ref=None, entropy=None):
    """Value of the loss, written from the formulas in the module docstring (no shared code)."""
    mask = mask.astype(bool)
    old = behav if cfg.pi_old == "bypass" else old
    s = cur - versions
    keep = mask & (s <= cfg.max_staleness)
    decay = np.where(s <= cfg.max_staleness, cfg.staleness_decay ** np.maximum(s, 0), 0.0)
    if cfg.tis == "token":
        w = np.minimum(np.exp(old - behav), cfg.tis_cap)
    elif cfg.tis == "sequence":
        w = np.minimum(np.exp((np.where(mask, old - behav, 0)).sum(-1, keepdims=True)), cfg.tis_cap) * np.ones_like(
            logp
        )
    else:
        w = np.ones_like(logp)
    A = adv[:, None] * np.ones_like(logp)
    if cfg.policy_loss == "gspo":
        n = np.maximum(keep.sum(-1, keepdims=True), 1)
        ratio = np.exp(np.where(keep, logp - old, 0).sum(-1, keepdims=True) / n) * np.ones_like(logp)
    else:
        ratio = np.exp(logp - old)
    pg = np.maximum(-A * ratio, -A * np.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
    if cfg.clip_c is not None:
        pg = np.where(A < 0, np.minimum(pg, -A * cfg.clip_c), pg)
    loss = np_agg(pg * w * decay, keep, cfg.loss_agg_mode, cfg.norm_len)
    if ref is not None and cfg.kl_coef:
        d = logp - ref
        c = np.clip(-d, -20, 20)  # verl's low_var_kl clamps ref - logp before the exp
        kl = {"k1": d, "k2": 0.5 * d**2, "k3": np.clip(np.exp(c) - c - 1, -10, 10)}[cfg.kl_type]
        loss += cfg.kl_coef * np_agg(kl, keep, cfg.loss_agg_mode, cfg.norm_len)
    if entropy is not None and cfg.entropy_coef:
        loss -= cfg.entropy_coef * np_agg(entropy, keep, cfg.loss_agg_mode, cfg.norm_len)
    return loss


def random_inputs(seed=0, stale=False):
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.2, 3.0, (B, T))
    old = behav + rng.normal(0, 0.3, (B, T))
    logp = old + rng.normal(0, 0.25, (B, T))
    lengths = np.array([7, 3, 5, 1, 6])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    versions = np.full((B, T), 4)
    if stale:
        versions = rng.integers(0, 5, (B, T))
    return dict(
        logp=logp,
        old=old,
        behav=behav,
        adv=rng.normal(0, 1, B),
        mask=mask,
        versions=versions,
        cur=4,
        ref=old + rng.normal(0, 0.2, (B, T)),
        entropy=rng.uniform(0.5, 2.0, (B, T)),
    )


def ours(cfg, x, logp=None, entropy=None):
    loss, metrics = policy_loss(
        cfg,
        logp_BT=jnp.asarray(x["logp"] if logp is None else logp, jnp.float32),
        old_logp_BT=jnp.asarray(x["old"], jnp.float32),
        behaviour_logp_BT=jnp.asarray(x["behav"], jnp.float32),
        advantages_B=jnp.asarray(x["adv"], jnp.float32),
        mask_BT=jnp.asarray(x["mask"]),
        versions_BT=jnp.asarray(x["versions"]),
        current_version=x["cur"],
        ref_logp_BT=jnp.asarray(x["ref"], jnp.float32),
        entropy_BT=jnp.asarray(x["entropy"] if entropy is None else entropy, jnp.float32),
    )
    return loss, metrics


def finite_diff(f, x, eps=1e-5):
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


VARIANTS = {f"ppo-{m}": LossConfig(loss_agg_mode=m, norm_len=10) for m in AGG_MODES}
VARIANTS.update(
    {
        "dual-clip": LossConfig(clip_c=1.5, clip_eps_low=0.1, clip_eps_high=0.1),
        "gspo": LossConfig(
            policy_loss="gspo",
            loss_agg_mode="seq-mean-token-mean",
            clip_eps_low=0.3,
            clip_eps_high=0.4,
            tis="sequence",
            tis_cap=5.0,
        ),
        "kl-k1": LossConfig(kl_coef=0.3, kl_type="k1"),
        "kl-k2": LossConfig(kl_coef=0.3, kl_type="k2"),
        "kl-k3": LossConfig(kl_coef=0.3, kl_type="k3"),
        "entropy": LossConfig(entropy_coef=0.05),
        "tis-sequence": LossConfig(tis="sequence", tis_cap=1.5),
        "no-tis": LossConfig(tis=None),
        "bypass": LossConfig(pi_old="bypass"),
        "stale-decay": LossConfig(max_staleness=2, staleness_decay=0.8),
    }
)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_loss_value_and_gradient_match_numpy(name):
    cfg = VARIANTS[name]
    x = random_inputs(seed=zlib.crc32(name.encode()) % 1000, stale=name.startswith("stale"))
    value, _ = ours(cfg, x)
    expected = np_loss(
        cfg, x["logp"], x["old"], x["behav"], x["adv"], x["mask"], x["versions"], x["cur"], x["ref"], x["entropy"]
    )
    np.testing.assert_allclose(float(value), expected, rtol=2e-5, atol=1e-6)
    grad = np.asarray(jax.grad(lambda lp: ours(cfg, x, logp=lp)[0])(jnp.asarray(x["logp"], jnp.float32)))
    fd = finite_diff(
        lambda lp: np_loss(
            cfg, lp, x["old"], x["behav"], x["adv"], x["mask"], x["versions"], x["cur"], x["ref"], x["entropy"]
        ),
        x["logp"],
    )
    np.testing.assert_allclose(grad, fd, atol=2e-4)
    assert np.all(grad[x["mask"] == 0] == 0)
    if cfg.entropy_coef:
        g_ent = np.asarray(jax.grad(lambda e: ours(cfg, x, entropy=e)[0])(jnp.asarray(x["entropy"], jnp.float32)))
        fd_ent = finite_diff(
            lambda e: np_loss(
                cfg, x["logp"], x["old"], x["behav"], x["adv"], x["mask"], x["versions"], x["cur"], x["ref"], e
            ),
            x["entropy"],
        )
        np.testing.assert_allclose(g_ent, fd_ent, atol=2e-4)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_padding_invariance(mode):
    cfg = LossConfig(loss_agg_mode=mode, norm_len=16, kl_coef=0.1)
    x = random_inputs(3)
    padded = {
        k: (
            np.concatenate([v, np.random.default_rng(9).normal(0, 5, (B, 4))], axis=1)
            if isinstance(v, np.ndarray) and v.shape == (B, T)
            else v
        )
        for k, v in x.items()
    }
    padded["mask"] = np.concatenate([x["mask"], np.zeros((B, 4))], axis=1)
    padded["versions"] = np.concatenate([x["versions"], np.zeros((B, 4), int)], axis=1)
    a, _ = ours(cfg, x)
    b, _ = ours(cfg, padded)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    ga = jax.grad(lambda lp: ours(cfg, x, logp=lp)[0])(jnp.asarray(x["logp"], jnp.float32))
    gb = jax.grad(lambda lp: ours(cfg, padded, logp=lp)[0])(jnp.asarray(padded["logp"], jnp.float32))
    np.testing.assert_allclose(np.asarray(gb)[:, :T], np.asarray(ga), atol=1e-7)
    assert np.all(np.asarray(gb)[:, T:] == 0)


def test_mis_shaped_inputs_fail_loudly_instead_of_broadcasting():
    """A [B, 1] old_logp or [B, 1] advantages would broadcast against [B, T] and train on wrong numbers."""
    x = random_inputs(0)
    for key, bad in (("old", x["old"][:, :1]), ("adv", x["adv"][:, None])):
        with pytest.raises(AssertionError, match="shape"):
            ours(LossConfig(), {**x, key: bad})


def test_all_current_versions_equal_plain_grpo():
    x = random_inputs(5)
    x["behav"] = x["old"]  # sampled by the current policy
    plain = LossConfig(tis=None, staleness_decay=1.0)
    mixed = LossConfig(tis="token", staleness_decay=0.9, max_staleness=5)
    a, ma = ours(plain, x)
    b, mb = ours(mixed, x)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-7)
    assert float(mb["train/off_policy_token_frac"]) == 0 and abs(float(mb["train/is_ratio_mean"]) - 1) < 1e-6


def test_staleness_masks_and_decays_exactly_the_right_tokens():
    cfg = LossConfig(tis=None, max_staleness=2, staleness_decay=0.9)
    x = random_inputs(7)
    x["mask"] = np.ones((B, T))
    grad = lambda xx: np.asarray(jax.grad(lambda lp: ours(cfg, xx, logp=lp)[0])(jnp.asarray(xx["logp"], jnp.float32)))
    base = grad(x)
    stale = dict(x, versions=x["versions"].copy())
    stale["versions"][0, 2] = x["cur"] - 1  # s = 1 -> weight 0.9
    stale["versions"][1, 4] = x["cur"] - 3  # s = 3 > cap -> masked
    g = grad(stale)
    # token-mean: the masked token also leaves the denominator, rescaling everything by N / (N - 1)
    n = x["mask"].sum()
    scale = n / (n - 1)
    assert g[1, 4] == 0
    np.testing.assert_allclose(g[0, 2], 0.9 * base[0, 2] * scale, rtol=1e-5)
    others = np.ones((B, T), bool)
    others[0, 2] = others[1, 4] = False
    np.testing.assert_allclose(g[others], base[others] * scale, rtol=1e-5)
    _, m = ours(cfg, stale)
    np.testing.assert_allclose(float(m["train/off_policy_token_frac"]), 2 / n, rtol=1e-6)


def test_positive_advantage_shares_count_tokens_plainly_and_as_the_loss_weights_them():
    cfg = LossConfig(tis="token", tis_cap=2.0, max_staleness=2, staleness_decay=0.9)
    x = random_inputs(11, stale=True)
    x["adv"][3] = 0.0  # a zero advantage is on neither side
    _, m = ours(cfg, x)
    mask = x["mask"].astype(bool)
    adv = np.broadcast_to(x["adv"][:, None], mask.shape)
    s = x["cur"] - x["versions"]
    weight = np.minimum(np.exp(x["old"] - x["behav"]), 2.0) * 0.9 ** np.maximum(s, 0) * (s <= 2)
    signed = mask & (adv != 0)
    np.testing.assert_allclose(
        float(m["train/positive_adv_token_share"]), (signed & (adv > 0)).sum() / signed.sum(), rtol=1e-6
    )
    w = np.where(signed, weight, 0.0)
    np.testing.assert_allclose(float(m["train/positive_adv_weight_share"]), w[adv > 0].sum() / w.sum(), rtol=1e-5)


def test_group_advantages_match_numpy():
    r = np.random.default_rng(0).normal(size=(4, 6))
    mean = r.mean(1, keepdims=True)
    np.testing.assert_allclose(
        group_advantages(r, mode="grpo"), (r - mean) / (r.std(1, ddof=1, keepdims=True) + 1e-6), rtol=1e-5
    )
    np.testing.assert_allclose(group_advantages(r, mode="drgrpo"), r - mean, rtol=1e-5, atol=1e-6)
    loo = np.stack([[r[g, i] - np.delete(r[g], i).mean() for i in range(6)] for g in range(4)])
    np.testing.assert_allclose(group_advantages(r, mode="rloo"), loo, rtol=1e-5, atol=1e-6)
    a = np.asarray(group_advantages(r, mode="drgrpo", batch_norm=True))
    assert abs(a.mean()) < 1e-6 and abs(a.std() - 1) < 1e-4
    assert np.all(np.asarray(group_advantages(np.ones((2, 4)))) == 0)  # equal rewards: no signal


def test_overlong_penalty_matches_dapo():
    lengths = np.array([10, 80, 90, 95, 100, 130])
    expected = [-min(max(L - (100 - 20), 0) / 20, 1) * 0.5 for L in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, 100, 20, 0.5), expected, rtol=1e-6)


def test_bad_loss_config_names_key():
    with pytest.raises(ValueError, match="loss.loss_agg_mode='mean'"):
        LossConfig(loss_agg_mode="mean").validate()
    with pytest.raises(ValueError, match="loss.tis='token' with loss.policy_loss='gspo'"):
        LossConfig(policy_loss="gspo").validate()
    with pytest.raises(ValueError, match="loss.policy_loss='dpo'"):
        dataclasses.replace(LossConfig(), policy_loss="dpo").validate()
