"""The sharded, micro-batched policy update.

Parameters and optimiser state are plain nested dicts of arrays (from the NNX state), each leaf
on its NamedSharding from the model's logical axes; the step is one `jax.jit` over the mesh with
explicit in/out shardings and donated params and optimiser state. Gradients accumulate over
micro-batches in a `lax.scan`, so activation memory is bounded by the micro-batch; the loss
divides by batch-wide denominators, so the micro-batched gradient equals the full-batch one.
A step whose loss, gradient or updated params are not finite is skipped (params and optimiser
state unchanged) and counted. Without a KL term or an entropy bonus, rows of zero advantage (GRPO
groups of equal rewards) carry no gradient: they are moved to the batch's end and a micro-batch of
only such rows is not computed, except the first, so a diverged model still shows in the loss
(`train/computed_rows_frac` is the share computed). The update is the same; the metrics other
than the loss then cover the computed micro-batches.

Batch (numpy or jax, S = padded prompt + response length, T = S - 1 prediction positions):
    input_ids [B, S] int32; loss_mask [B, T] (1 where the target token is a response token);
    behaviour_logp [B, T]; versions [B, T] int32; advantages [B]; optional old_logp, ref_logp [B, T].

Per rollout batch (`update`, as verl): `prepare` fixes pi_old (the logprobs of the params before
the first epoch, or the behaviour logprobs when pi_old='bypass') and, when kl_coef > 0, the frozen
reference's logprobs; then `num_iterations` optimiser steps (PPO epochs) reuse both, so from the
second epoch on the ratio pi / pi_old moves away from 1 and the clip can bind. The reference is
the initial params (or a given model), kept on the mesh with the policy's shardings; with
kl_coef == 0 none is kept. With one epoch (and pi_old='recompute') pi_old is the params being
differentiated, so it is the training forward's own logprobs under stop_gradient (as TRL does):
no separate logprob pass, a quarter of the step's FLOPs.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from april_jax.config.schema import key
from april_jax.models import lora as lora_lib
from april_jax.models.qwen3 import Qwen3
from april_jax.models.sharding import logical_sharding
from april_jax.rl.losses import LossConfig, denominators, effective_mask, policy_loss


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping; each field is the config key `optimizer.<field>`."""

    lr: float = key(1e-6, "peak learning rate of the policy update", ge=0, finite=True)
    warmup_steps: int = key(0, "optimiser steps of linear learning-rate warm-up from 0", ge=0)
    total_steps: int = key(
        0, "optimiser steps the cosine schedule spans; 0: train.total_steps x train.num_iterations", ge=0
    )
    schedule: str = key("constant", "learning-rate schedule after the warm-up", choices=("constant", "cosine"))
    weight_decay: float = key(0.0, "AdamW decoupled weight decay", ge=0)
    b1: float = key(0.9, "Adam beta1", ge=0, le=1)
    b2: float = key(0.999, "Adam beta2", ge=0, le=1)
    eps: float = key(1e-8, "Adam epsilon", gt=0)
    max_grad_norm: float = key(1.0, "clip the gradient to this global norm", gt=0)


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate per optimiser step (one step per `Trainer.step`, i.e. per PPO epoch)."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"optimizer.schedule={cfg.schedule!r}: expected 'constant' or 'cosine'")
    warmup = max(cfg.warmup_steps, 0)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(warmup, 1), max(cfg.total_steps, warmup + 1))
    if warmup:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup]
        )
    return optax.constant_schedule(cfg.lr)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    schedule = make_schedule(cfg)
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(schedule, cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay),
    )


# Sequence positions whose [B, C, V] fp32 logits exist at once in `token_logprobs`; 0: all of them.
# At Qwen3's vocabulary of 151,936 a row's 1024 positions are 0.6 GB of logits, a 16k-token row's
# would be 10 GB (and as much again for the probabilities). Read when the step is traced.
LOGPROB_CHUNK = 1024


def _logprobs_and_entropy(model: Qwen3, hidden_BCM, targets_BC, temperature: float, entropy_grad: bool):
    """(logp_BC, entropy_BC) of positions whose final hidden states are `hidden_BCM`.

    Via logsumexp rather than a materialised log_softmax (one less [B, C, V] pass).
    """
    logits_BCV = model.logits(hidden_BCM).astype(jnp.float32) / temperature
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    logp_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0] - lse_BC
    maybe_sg = (lambda x: x) if entropy_grad else jax.lax.stop_gradient
    probs_BCV = jnp.exp(maybe_sg(logits_BCV) - maybe_sg(lse_BC)[..., None])
    entropy_BC = maybe_sg(lse_BC) - jnp.sum(probs_BCV * maybe_sg(logits_BCV), axis=-1)
    return logp_BC, entropy_BC


def token_logprobs(
    model: Qwen3, input_ids_BS, temperature: float = 1.0, entropy_grad: bool = False, chunk: int | None = None
):
    """(logp_BT, entropy_BT) of each next token, fp32, at the sampling temperature.

    The entropy carries no gradient unless `entropy_grad` (it is then only a metric). The logits
    are made `chunk` positions at a time (default `LOGPROB_CHUNK`; 0 or T <= chunk: all at once),
    each chunk rematerialised in the backward: the step never holds the [B, T, V] logits, whose
    fp32 size grows with the response length times the vocabulary.
    """
    chunk = LOGPROB_CHUNK if chunk is None else chunk
    hidden_BTM, _ = model.hidden(input_ids_BS[:, :-1])
    targets_BT = input_ids_BS[:, 1:]
    per_chunk = partial(_logprobs_and_entropy, model, temperature=temperature, entropy_grad=entropy_grad)
    B, T, M = hidden_BTM.shape
    if chunk <= 0 or T <= chunk:
        return per_chunk(hidden_BTM, targets_BT)
    n = -(-T // chunk)
    C = -(-T // n)  # n equal chunks of at most `chunk`: fewer than n padded positions, not a chunk's worth
    pad = n * C - T
    hidden_NBCM = jnp.pad(hidden_BTM, ((0, 0), (0, pad), (0, 0))).reshape(B, n, C, M).swapaxes(0, 1)
    targets_NBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n, C).swapaxes(0, 1)
    # Nothing inside a chunk is kept for the backward, which recomputes the chunk's logits from its
    # hidden states: one more lm-head matmul instead of [B, T, V] logits and probabilities held
    # from the forward to the backward.
    remat_chunk = jax.checkpoint(lambda xs: per_chunk(*xs), prevent_cse=False)
    logp_NBC, entropy_NBC = jax.lax.map(remat_chunk, (hidden_NBCM, targets_NBC))
    unchunk = lambda x_NBC: x_NBC.swapaxes(0, 1).reshape(B, n * C)[:, :T]
    return unchunk(logp_NBC), unchunk(entropy_NBC)


def _nest(flat: dict[tuple, object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return out


class Trainer:
    """Holds params + optimiser state on the mesh and runs policy updates."""

    def __init__(
        self,
        model: Qwen3,
        loss_cfg: LossConfig,
        opt_cfg: OptimizerConfig,
        *,
        mesh: Mesh | None = None,
        micro_batch_size: int | None = None,
        temperature: float = 1.0,
        reference: Qwen3 | None = None,
        lora: lora_lib.LoRAConfig | None = None,
    ):
        """`reference`: the frozen KL reference (same architecture); None: the initial params (with
        `lora`: the same model with its adapters off, no copy). Only kept when loss_cfg.kl_coef > 0.

        `lora` with rank > 0: adapters are added to the target projections of (a view of) `model`,
        which becomes the frozen base in the compute dtype; `params` and `opt_state` are the
        adapters' only. `model()` / `nnx_state()` are then the merged weights."""
        self.loss_cfg = loss_cfg.validate()
        self.opt_cfg = opt_cfg
        self.mesh = mesh
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.model_cfg = model.cfg
        self.lora = lora if lora is not None and lora.rank else None
        self.base = {}
        if self.lora is not None:
            model = self._add_adapters(model)
            self.graphdef, state, base = nnx.split(model, lora_lib.LoRAParam, ...)
            compute = model.cfg.dtype
            # The forward casts every weight to the compute dtype anyway: keeping the frozen base in
            # it is the same numbers for half the memory under bf16 compute.
            self.base = jax.tree.map(lambda x: x.astype(compute), nnx.to_pure_dict(base))
            self._base_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute), base)
        else:
            self.graphdef, state = nnx.split(model)
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        self.tx = make_optimizer(opt_cfg)
        self.skipped_steps = 0
        self.step_count = 0
        flat = nnx.to_flat_state(state)
        if mesh is not None:
            self.param_shardings = _nest(
                {p: logical_sharding(v.get_metadata()["logical_axes"], v.get_value().shape, mesh) for p, v in flat}
            )
            replicated = NamedSharding(mesh, P())
            abstract_opt = jax.eval_shape(self.tx.init, nnx.to_pure_dict(state))
            self.opt_shardings = optax.tree_map_params(
                self.tx, lambda _, s: s, abstract_opt, self.param_shardings, transform_non_params=lambda _: replicated
            )
            self.params = jax.device_put(nnx.to_pure_dict(state), self.param_shardings)
            self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        else:
            self.param_shardings = self.opt_shardings = None
            self.params = nnx.to_pure_dict(state)
            self.opt_state = jax.jit(self.tx.init)(self.params)
        self._step_fns: dict = {}
        # What the KL reference's logprobs run: "policy" (ref_params through the policy's graph),
        # "plain" (ref_params through the base's graph: a LoRA run with loss.ref_path) or
        # "adapters_off" (the LoRA policy's own base, no copy).
        self._ref_kind = "plain" if self.lora is not None else "policy"
        if self.lora is not None and reference is None:
            self._ref_kind, self.ref_params = "adapters_off", None
        else:
            self.ref_params = self._reference_params(reference) if self.loss_cfg.kl_coef else None
        self._opt_device_shardings = None  # set while the optimizer state is on the host

    def _add_adapters(self, model: Qwen3) -> Qwen3:
        """A new module on `model`'s arrays (the caller's model stays without adapters) with fresh
        adapters; keeps the plain model's graph and shardings for the merged views."""
        plain_graphdef, plain_state = nnx.split(model)
        self._plain_graphdef = plain_graphdef
        self._plain_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain_state)
        self._plain_shardings = None
        if self.mesh is not None:
            flat = nnx.to_flat_state(plain_state)
            self._plain_shardings = _nest(
                {p: logical_sharding(v.get_metadata()["logical_axes"], v.get_value().shape, self.mesh) for p, v in flat}
            )
        model = lora_lib.add_adapters(nnx.merge(plain_graphdef, plain_state), self.lora, self.mesh)
        self._ref_graphdef = nnx.split(lora_lib.set_enabled(model, False))[0]
        lora_lib.set_enabled(model, True)
        # Merged, not unmerged: the engine then runs the plain model's programs unchanged (no
        # adapter matmuls in every decode step) for one W + AB per sync, the cheap side at RL's
        # one sync per step.
        kw = {} if self.mesh is None else dict(out_shardings=self._plain_shardings)
        self._merge_fn = jax.jit(partial(lora_lib.merge, scale=self.lora.scale), **kw)
        return model

    def _reference_params(self, reference: Qwen3 | None):
        """A device copy of the reference's params with the policy's shardings (never via the host).
        The policy's own buffers are donated to every step, so the initial params are copied."""
        like = self.params if self.lora is None else self._plain_abstract
        shardings = self.param_shardings if self.lora is None else self._plain_shardings
        if reference is not None:
            source = nnx.to_pure_dict(nnx.state(reference))
            describe = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
            if describe(source) != describe(nnx.to_pure_dict(like) if self.lora is not None else like):
                raise ValueError(
                    "loss.ref_path: the reference model's parameter shapes/dtypes differ from the policy's"
                )
            # already on the mesh when loaded with it: then a no-op
            return source if self.mesh is None else jax.device_put(source, shardings)
        kw = {} if self.mesh is None else dict(out_shardings=self.param_shardings)
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), **kw)(self.params)

    # ---- model views ----
    def _policy(self, params, base, enabled: bool = True) -> Qwen3:
        """The model being differentiated: `params` (with LoRA: the adapters, on `base`)."""
        state = jax.tree.map(lambda x: x, self.abstract)
        nnx.replace_by_pure_dict(state, params)
        if self.lora is None:
            return nnx.merge(self.graphdef, state)
        base_state = jax.tree.map(lambda x: x, self._base_abstract)
        nnx.replace_by_pure_dict(base_state, base)
        return nnx.merge(self.graphdef if enabled else self._ref_graphdef, state, base_state)

    def _plain(self, params) -> Qwen3:
        state = jax.tree.map(lambda x: x, self._plain_abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self._plain_graphdef, state)

    def model(self, params=None) -> Qwen3:
        """The policy as a plain model: with LoRA, the base with `params`' adapters merged in."""
        params = self.params if params is None else params
        if self.lora is None:
            return self._policy(params, self.base)
        return self._plain(self._merge_fn(self.base, params))

    def lora_meta(self) -> dict | None:
        """What a checkpoint records of the adapters (None: full fine-tuning)."""
        if self.lora is None:
            return None
        return {
            "rank": self.lora.rank,
            "alpha": self.lora.alpha,
            "targets": list(self.lora.targets),
            "base": self.lora.base,
        }

    def nnx_state(self) -> nnx.State:
        """The parameters as an nnx.State (what engines' update_weights takes)."""
        return nnx.state(self.model())

    # ---- batches ----
    def _batch_sharding(self, x):
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, P(("data", "fsdp"), *([None] * (np.ndim(x) - 1))))

    def _put(self, batch: dict) -> dict:
        batch = {k: jnp.asarray(v) for k, v in batch.items() if v is not None and k != "rewards"}
        if self.mesh is None:
            return batch
        return {k: jax.device_put(v, self._batch_sharding(v)) for k, v in batch.items()}

    def _micro(self, batch_size: int) -> int:
        mb = self.micro_batch_size or batch_size
        if batch_size % mb:
            raise ValueError(f"train.micro_batch_size={mb} does not divide the batch of {batch_size} sequences")
        return batch_size // mb

    # ---- logprobs before the update (pi_old) and of a reference ----
    def logprobs(self, input_ids_BS, params=None, view: str = "policy"):
        """Logprobs of the policy (or `params` seen as `view`: see `_ref_kind`)."""
        batch = self._put({"input_ids": input_ids_BS})
        n_micro = self._micro(batch["input_ids"].shape[0])
        fn = self._jitted("logprobs", n_micro, view)
        return fn(self.params if params is None else params, self.base, batch["input_ids"])

    def _jitted(self, kind: str, n_micro: int, with_ref=False):
        key = (kind, n_micro, with_ref)
        if key not in self._step_fns:
            if kind == "logprobs":
                self._step_fns[key] = jax.jit(partial(self._logprobs_impl, n_micro, with_ref))
            elif kind == "grads":
                self._step_fns[key] = jax.jit(partial(self._grads_impl, n_micro))
            else:
                kw = {}
                if self.mesh is not None:
                    kw = dict(out_shardings=(self.param_shardings, self.opt_shardings, None))
                self._step_fns[key] = jax.jit(partial(self._step_impl, n_micro), donate_argnums=(0, 1), **kw)
        return self._step_fns[key]

    def _logprobs_impl(self, n_micro, view, params, base, input_ids_BS):
        if view == "plain" and self.lora is not None:
            model = self._plain(params)
        else:
            model = self._policy(params, base, enabled=view != "adapters_off")
        micro = input_ids_BS.reshape(n_micro, -1, input_ids_BS.shape[-1])
        logp = jax.lax.map(lambda ids: token_logprobs(model, ids, self.temperature)[0], micro)
        return logp.reshape(input_ids_BS.shape[0], -1)

    def prepare(self, batch: dict, fix_pi_old: bool = True) -> dict:
        """The batch on the mesh with what stays fixed over its PPO epochs: old_logp (pi_old, unless
        given) and ref_logp (when kl_coef > 0, unless given). Call once per rollout batch. For a
        single step (`fix_pi_old` False) with pi_old='recompute', old_logp stays absent: the step
        takes the training forward's own logprobs (the same params), saving a forward pass."""
        batch = self._put(batch)
        if batch.get("old_logp") is None:
            if self.loss_cfg.pi_old != "recompute":
                batch["old_logp"] = batch["behaviour_logp"]
            elif fix_pi_old:
                batch["old_logp"] = self.logprobs(batch["input_ids"])
            else:
                batch.pop("old_logp", None)
        if self.loss_cfg.kl_coef and batch.get("ref_logp") is None:
            ref = self.params if self._ref_kind == "adapters_off" else self.ref_params
            batch["ref_logp"] = self.logprobs(batch["input_ids"], ref, self._ref_kind)
        return self._put(batch)

    # ---- the update ----
    def update(self, batch: dict, current_version: int, num_iterations: int = 1) -> dict:
        """One rollout batch: pi_old and the reference logprobs once, then `num_iterations`
        optimiser steps on it. Metrics are the mean over the epochs (verl's reduction), except
        train/skipped (summed) and train/skipped_steps (the running total)."""
        prepared = self.prepare(batch, fix_pi_old=num_iterations > 1)
        epochs = [self.step(prepared, current_version) for _ in range(num_iterations)]
        metrics = {k: float(np.mean([m[k] for m in epochs])) for k in epochs[0]}
        metrics["train/skipped"] = sum(m["train/skipped"] for m in epochs)
        metrics["train/skipped_steps"] = self.skipped_steps
        return metrics

    def step(self, batch: dict, current_version: int) -> dict:
        """One optimiser step on `batch` (see module docstring). An unprepared batch gets its pi_old
        from the current params: call `prepare` once when stepping on one batch several times."""
        if self.optimizer_offloaded:
            raise RuntimeError("Trainer.step: the optimizer state is on the host; call restore_optimizer() first")
        batch = self.prepare(batch, fix_pi_old=False)
        n_micro = self._micro(batch["input_ids"].shape[0])
        fn = self._jitted("step", n_micro, "ref_logp" in batch)
        self.params, self.opt_state, metrics = fn(
            self.params, self.opt_state, self.base, batch, jnp.int32(current_version)
        )
        metrics = {k: float(v) for k, v in metrics.items()}
        self.skipped_steps += int(metrics["train/skipped"])
        self.step_count += 1
        metrics["train/skipped_steps"] = self.skipped_steps
        return metrics

    # ---- the optimizer state on the host while the engine generates ----
    @property
    def optimizer_offloaded(self) -> bool:
        return self._opt_device_shardings is not None

    def offload_optimizer(self) -> None:
        """Move the optimizer state to host memory and free its device buffers: a rollout never
        reads it, and its room goes to the engine's KV cache. `restore_optimizer` brings it back
        bit for bit, on the same shardings. Meanwhile `opt_state` is the host copy (a checkpoint
        can save it as it is). A no-op when it is on the host already."""
        if self.optimizer_offloaded:
            return
        shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
        self.opt_state = self._moved(self.opt_state, self._host_copy(self.opt_state, shardings))
        self._opt_device_shardings = shardings

    def restore_optimizer(self) -> None:
        """The optimizer state back on its device shardings (before an update); a no-op when it is there."""
        if not self.optimizer_offloaded:
            return
        shardings, self._opt_device_shardings = self._opt_device_shardings, None
        self.opt_state = self._moved(self.opt_state, jax.device_put(self.opt_state, shardings))

    @staticmethod
    def _host_copy(tree, shardings):
        """A host copy of `tree`: arrays in 'pinned_host' memory on the same shardings where the
        backend has that memory kind (GPU, TPU, CPU), else numpy copies; `jax.device_put` with the
        device shardings brings either back."""
        kind = Trainer._host_memory_kind()
        if kind is not None:
            return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(kind), shardings))
        if not all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
            raise RuntimeError(
                "Trainer.offload_optimizer: no host memory kind on this backend for a multi-process state"
            )
        return jax.tree.map(np.array, tree)  # a copy: on CPU, device_get may alias the buffer

    @staticmethod
    def _host_memory_kind() -> str | None:
        try:
            kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
        except (AttributeError, NotImplementedError, RuntimeError):  # a backend without memory kinds
            return None
        return "pinned_host" if "pinned_host" in kinds else None

    @staticmethod
    def _moved(old, new):
        """`new` once its copy is complete, with `old`'s buffers deleted: the memory is free on return."""
        jax.block_until_ready(new)
        kept = {id(x) for x in jax.tree.leaves(new)}  # a leaf already where it was asked to go is not a copy
        for x in jax.tree.leaves(old):
            if isinstance(x, jax.Array) and id(x) not in kept:
                x.delete()
        return new

    def loss_and_grads(self, batch: dict, current_version: int):
        """(metrics, grads) without updating: for tests and diagnostics."""
        batch = dict(batch)
        if batch.get("old_logp") is None:
            batch["old_logp"] = batch["behaviour_logp"]
        batch = self.prepare(batch)
        fn = self._jitted("grads", self._micro(batch["input_ids"].shape[0]), "ref_logp" in batch)
        grads, metrics = fn(self.params, self.base, batch, jnp.int32(current_version))
        return metrics, grads

    def _step_impl(self, n_micro, params, opt_state, base, batch, current_version):
        grads, metrics = self._grads_impl(n_micro, params, base, batch, current_version)
        grad_norm = metrics["train/grad_norm"]
        updates, new_opt = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(metrics["train/loss"]) & jnp.isfinite(grad_norm)
        # A finite gradient can still make non-finite params (lr=inf, fp32 overflow): check them too.
        ok &= jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new_params)]))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        metrics["train/skipped"] = (~ok).astype(jnp.int32)
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    def _grads_impl(self, n_micro, params, base, batch, current_version):
        batch = {k: v for k, v in batch.items() if k != "rewards"}
        mask_eff_BT = effective_mask(self.loss_cfg, batch["loss_mask"], batch["versions"], current_version)
        denoms = denominators(mask_eff_BT)
        B = batch["input_ids"].shape[0]
        # Without a KL term or an entropy bonus, a row whose advantage is 0 (a group of equal
        # rewards, GRPO's common case) contributes exactly zero gradient. Those rows go last and a
        # micro-batch made only of them skips its forward and backward: the same update for less.
        skip_idle = not self.loss_cfg.kl_coef and not self.loss_cfg.entropy_coef
        if skip_idle:
            trains_B = (batch["advantages"] != 0) & mask_eff_BT.any(-1)
            order_B = jnp.argsort(~trains_B, stable=True)
            batch = jax.tree.map(lambda x: jnp.take(x, order_B, axis=0), batch)
            mask_eff_BT, trains_B = mask_eff_BT[order_B], trains_B[order_B]
        else:
            trains_B = jnp.ones((B,), bool)
        micro = jax.tree.map(lambda x: x.reshape(n_micro, -1, *x.shape[1:]), batch)
        # The first micro-batch always runs (after the sort it holds the rows that train, if any):
        # a model gone non-finite still shows in the loss when every reward was equal.
        computed_M = trains_B.reshape(n_micro, -1).any(-1).at[0].set(True)

        def loss_fn(p, mb):
            logp, entropy = token_logprobs(
                self._policy(p, base), mb["input_ids"], self.temperature, entropy_grad=bool(self.loss_cfg.entropy_coef)
            )
            return policy_loss(
                self.loss_cfg,
                logp_BT=logp,
                old_logp_BT=mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp),
                behaviour_logp_BT=mb["behaviour_logp"],
                advantages_B=mb["advantages"],
                mask_BT=mb["loss_mask"],
                versions_BT=mb["versions"],
                current_version=current_version,
                denoms=denoms,
                ref_logp_BT=mb.get("ref_logp"),
                entropy_BT=entropy,
            )

        first = jax.tree.map(lambda x: x[0], micro)
        metric_shapes = jax.eval_shape(lambda: loss_fn(params, first)[1])

        def body(grads, xs):
            mb, computed = xs

            def compute():
                (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
                return jax.tree.map(jnp.add, grads, g), metrics

            def idle():
                return grads, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)

            return jax.lax.cond(computed, compute, idle) if skip_idle else compute()

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(body, zeros, (micro, computed_M))
        # Sums of batch-normalised terms add up across micro-batches; the entropy, a metric only,
        # is rescaled to the rows computed; per-micro-batch means average over those computed.
        computed_rows_B = jnp.repeat(computed_M, B // n_micro)
        entropy_scale = 1.0
        if skip_idle:
            denoms_computed = denominators(mask_eff_BT & computed_rows_B[:, None])
            unit = "tokens" if self.loss_cfg.loss_agg_mode == "token-mean" else "seqs"
            entropy_scale = denoms[unit] / denoms_computed[unit]
        weight_M = computed_M.astype(jnp.float32)
        summed = ("train/loss", "train/pg_loss", "train/kl")

        def reduce(name, v):
            if name in summed:
                return v.sum()
            if name == "train/entropy":
                return v.sum() * entropy_scale
            return (v * weight_M).sum() / jnp.maximum(weight_M.sum(), 1.0)

        metrics = {k: reduce(k, v) for k, v in metrics.items()}
        metrics["train/computed_rows_frac"] = computed_rows_B.mean(dtype=jnp.float32)
        metrics["train/grad_norm"] = optax.tree.norm(grads)
        return grads, metrics
