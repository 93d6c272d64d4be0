"""Mixed-policy PPO/GRPO/DAPO/GSPO policy loss over response tokens.

All per-token arrays are [B, T] (B sequences, T response positions, right-padded; `mask_BT` marks
real response tokens). Names follow verl where it has them.

Per token, with r = exp(logp - logp_old) and advantage A:
    ppo:  max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); dual clip (A < 0): min(that, -A c)
    gspo: r replaced by the sequence ratio exp(mean_t(logp - logp_old)) (value), whose gradient
          flows through each token's logp (verl's GSPO), clipped the same way.
Mixed-policy correction (APRIL: a response may span several policy versions):
    w_tis  = min(exp(logp_old - logp_behaviour), C), token- or sequence-level, no gradient
    s      = current_version - token_version; tokens with s > max_staleness are masked,
             the rest weighted decay ** s.
    per-token loss = pg * w_tis * decay ** s
KL to a frozen reference policy (verl's use_kl_loss, `kl_coef * agg(kl_BT)`) and an entropy bonus
are added with their coefficients. Per token, with d = logp - ref_logp (verl's kl_penalty):
    k1: d        k2: d^2 / 2        k3 (low_var_kl): clip(exp(c) - c - 1, -10, 10), c = clip(-d, -20, 20)
Positions outside the mask enter as d = 0 before the exp, so padding with any logp (say -1e4)
cannot turn the gradient into inf * 0 = NaN.

Aggregation (`loss_agg_mode`) counts only tokens within the staleness cap, and takes its
denominators from `denoms` (of `effective_mask` over the whole batch) so that micro-batches of one
batch sum to exactly the full-batch loss: token-mean (/ all tokens), seq-mean-token-sum
(/ sequences), seq-mean-token-mean (per-sequence mean, / sequences), seq-mean-token-sum-norm
(/ (sequences x norm_len), Dr. GRPO, with a fixed norm_len so padding does not change it).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from april_jax.config.schema import check_fields, internal, key

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The loss's settings; each field is also the config key `loss.<field>` (april_jax/config/keys.py
    adds the keys that only the trainer reads and gives clip_c/tis/norm_len their config forms)."""

    policy_loss: str = key("ppo", "ratio per token (PPO/GRPO/DAPO) or per sequence (GSPO)", choices=("ppo", "gspo"))
    clip_eps_low: float = key(0.2, "lower PPO clip: ratios below 1 - clip_eps_low are clipped", ge=0)
    clip_eps_high: float = key(
        0.28, "upper PPO clip: ratios above 1 + clip_eps_high are clipped (DAPO clip-higher)", ge=0
    )
    clip_c: float | None = internal(None, "dual-clip constant for negative advantages (e.g. 3.0); None: off")
    loss_agg_mode: str = key(
        "token-mean", "how token losses are averaged over the batch (verl's loss_agg_mode)", choices=AGG_MODES
    )
    norm_len: int = internal(1024, "seq-mean-token-sum-norm's constant (the generation budget)")
    kl_coef: float = key(
        0.0, "weight of the KL to the frozen reference policy (verl's use_kl_loss); 0: no KL", ge=0, finite=True
    )
    kl_type: str = key(
        "k3", "KL estimator: k1 (log ratio), k2 (squared / 2), k3 (verl's low_var_kl)", choices=("k1", "k2", "k3")
    )
    entropy_coef: float = key(0.0, "weight of the entropy bonus (subtracted from the loss); 0: off", finite=True)
    pi_old: str = key(
        "recompute",
        "pi_old: the trainer's logprobs before the batch's first epoch (one epoch: the update's own forward), or 'bypass' (the engine's behaviour logprobs)",
        choices=("recompute", "bypass"),
    )
    tis: str | None = internal("token", "truncated importance sampling: 'token', 'sequence' or None")
    tis_cap: float = key(2.0, "truncated-IS cap C: weights min(pi_old / pi_behaviour, C)", gt=0)
    max_staleness: int = internal(4, "tokens older than this many policy versions are masked (rollout.max_staleness)")
    staleness_decay: float = key(0.9, "per-token weight decay ** (current version - token's version)", gt=0, le=1)

    def validate(self) -> LossConfig:
        check_fields(self, "loss")
        if self.tis not in ("token", "sequence", None):
            raise ValueError(f"loss.tis={self.tis!r}: expected one of ('token', 'sequence', None)")
        if self.policy_loss == "gspo" and self.tis == "token":
            raise ValueError(
                "loss.tis='token' with loss.policy_loss='gspo': GSPO weighs whole sequences; "
                "use loss.tis='sequence' or None"
            )
        if self.norm_len <= 0:
            raise ValueError(f"loss.norm_len={self.norm_len}: must be > 0")
        return self


def denominators(mask_BT) -> dict:
    """Batch-wide counts the aggregation divides by (compute once over the full batch)."""
    mask = mask_BT.astype(jnp.float32)
    return {"tokens": jnp.maximum(mask.sum(), 1.0), "seqs": jnp.maximum((mask.sum(-1) > 0).sum(), 1.0)}


def effective_mask(cfg: LossConfig, mask_BT, versions_BT, current_version):
    """Response tokens within the staleness cap: what the loss trains on and divides by."""
    return mask_BT.astype(bool) & (current_version - versions_BT <= cfg.max_staleness)


def aggregate(x_BT, mask_BT, mode: str, denoms: dict, norm_len: int = 1024):
    mask = mask_BT.astype(jnp.float32)
    x = jnp.where(mask > 0, x_BT, 0.0)
    if mode == "token-mean":
        return x.sum() / denoms["tokens"]
    if mode == "seq-mean-token-sum":
        return x.sum() / denoms["seqs"]
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum() / denoms["seqs"]
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (denoms["seqs"] * norm_len)
    raise ValueError(f"loss.loss_agg_mode={mode!r}: expected one of {AGG_MODES}")


def kl_penalty(logp_BT, ref_logp_BT, kind: str, mask_BT=None):
    """Per-token KL estimate of pi vs the reference (verl's kl_penalty); 0 outside `mask_BT`."""
    d = logp_BT - ref_logp_BT
    if mask_BT is not None:
        d = jnp.where(mask_BT.astype(bool), d, 0.0)  # before the exp: a masked -1e4 must not reach it
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":  # low_var_kl: exp(ref - logp) - (ref - logp) - 1, both clamps as in verl
        c = jnp.clip(-d, -20.0, 20.0)
        return jnp.clip(jnp.exp(c) - c - 1.0, -10.0, 10.0)
    raise ValueError(f"loss.kl_type={kind!r}: expected one of ('k1', 'k2', 'k3')")


def _masked_mean(x_BT, mask_BT):
    m = mask_BT.astype(jnp.float32)
    return jnp.where(m > 0, x_BT, 0.0).sum() / jnp.maximum(m.sum(), 1.0)


def _positive_share(weight_BT, adv_BT, mask_BT):
    w_BT = jnp.where(mask_BT & (adv_BT != 0), weight_BT, 0.0)
    return jnp.where(adv_BT > 0, w_BT, 0.0).sum() / jnp.maximum(w_BT.sum(), 1e-12)


def policy_loss(
    cfg: LossConfig,
    *,
    logp_BT,
    old_logp_BT,
    behaviour_logp_BT,
    advantages_B,
    mask_BT,
    versions_BT,
    current_version,
    denoms: dict | None = None,
    ref_logp_BT=None,
    entropy_BT=None,
):
    """(loss, metrics). Gradients flow through `logp_BT` (and `entropy_BT`) only."""
    # Shapes are static, so these checks cost nothing inside jit; without them a [B, 1] or [T]
    # array would broadcast against [B, T] and train on the wrong numbers without an error.
    chex.assert_rank(logp_BT, 2)
    chex.assert_equal_shape(
        [logp_BT, old_logp_BT, behaviour_logp_BT, mask_BT, versions_BT]
        + [x for x in (ref_logp_BT, entropy_BT) if x is not None]
    )
    chex.assert_shape(advantages_B, (logp_BT.shape[0],))
    mask = mask_BT.astype(bool)
    old = jax.lax.stop_gradient(behaviour_logp_BT if cfg.pi_old == "bypass" else old_logp_BT)
    behaviour = jax.lax.stop_gradient(behaviour_logp_BT)
    adv_BT = jnp.broadcast_to(advantages_B[:, None], mask.shape).astype(jnp.float32)

    # staleness: mask beyond the cap, decay the rest
    staleness_BT = current_version - versions_BT
    fresh_enough = staleness_BT <= cfg.max_staleness
    decay_BT = jnp.where(fresh_enough, cfg.staleness_decay ** jnp.clip(staleness_BT, 0, None).astype(jnp.float32), 0.0)
    mask_eff = mask & fresh_enough
    denoms = denominators(mask_eff) if denoms is None else denoms

    # truncated importance sampling pi_old / pi_behaviour
    log_is_BT = jnp.where(mask, old - behaviour, 0.0)
    if cfg.tis == "sequence":
        log_is_BT = jnp.broadcast_to(log_is_BT.sum(-1, keepdims=True), mask.shape)
    is_ratio_BT = jnp.exp(jnp.clip(log_is_BT, -20.0, 20.0))
    tis_BT = jnp.minimum(is_ratio_BT, cfg.tis_cap) if cfg.tis else jnp.ones_like(is_ratio_BT)

    # PPO / GSPO clipped surrogate
    log_ratio_BT = jnp.where(mask_eff, logp_BT - old, 0.0)
    if cfg.policy_loss == "gspo":
        n_B = jnp.maximum(mask_eff.sum(-1, keepdims=True), 1)
        seq_log_ratio = jax.lax.stop_gradient(log_ratio_BT.sum(-1, keepdims=True) / n_B)
        log_ratio_BT = logp_BT - jax.lax.stop_gradient(logp_BT) + seq_log_ratio
    ratio_BT = jnp.exp(jnp.clip(log_ratio_BT, -20.0, 20.0))
    pg1 = -adv_BT * ratio_BT
    pg2 = -adv_BT * jnp.clip(ratio_BT, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_BT = jnp.maximum(pg1, pg2)
    if cfg.clip_c is not None:
        pg_BT = jnp.where(adv_BT < 0, jnp.minimum(pg_BT, -adv_BT * cfg.clip_c), pg_BT)
    weighted_BT = pg_BT * tis_BT * decay_BT

    pg_loss = aggregate(weighted_BT, mask_eff, cfg.loss_agg_mode, denoms, cfg.norm_len)
    loss = pg_loss
    metrics = {
        "train/pg_loss": pg_loss,
        "train/pg_clipfrac": _masked_mean((pg2 > pg1).astype(jnp.float32), mask_eff),
        "train/ppo_kl": _masked_mean(-log_ratio_BT, mask_eff),
        "train/is_ratio_mean": _masked_mean(is_ratio_BT, mask),
        "train/tis_clipfrac": _masked_mean((is_ratio_BT > cfg.tis_cap).astype(jnp.float32), mask) if cfg.tis else 0.0,
        "train/off_policy_token_frac": _masked_mean((staleness_BT > 0).astype(jnp.float32), mask),
        "train/stale_masked_frac": _masked_mean((~fresh_enough).astype(jnp.float32), mask),
        # Which side of the advantage the loss hears: the share of tokens with A > 0 among tokens
        # with A != 0, counted plainly and weighted as the loss weights them (staleness cap, decay,
        # truncated IS). A gap means stale tokens are mostly on one side: the correction then
        # tilts the update towards the other (say, towards long failing responses).
        "train/positive_adv_token_share": _positive_share(jnp.ones_like(adv_BT), adv_BT, mask),
        "train/positive_adv_weight_share": _positive_share(tis_BT * decay_BT, adv_BT, mask_eff),
    }
    if ref_logp_BT is not None and cfg.kl_coef:
        kl_BT = kl_penalty(logp_BT, jax.lax.stop_gradient(ref_logp_BT), cfg.kl_type, mask_eff)
        kl = aggregate(kl_BT, mask_eff, cfg.loss_agg_mode, denoms, cfg.norm_len)
        loss = loss + cfg.kl_coef * kl
        metrics["train/kl"] = kl
    if entropy_BT is not None:
        entropy = aggregate(entropy_BT, mask_eff, cfg.loss_agg_mode, denoms, cfg.norm_len)
        metrics["train/entropy"] = entropy
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
    metrics["train/loss"] = loss
    return loss, metrics
