"""LoRA adapters on the Qwen3 projections: y = x W^T + (x A) B * alpha / r.

A [in, r] and B [r, out] are fp32 `LoRAParam`s on a target `Linear` (`lora_a`, `lora_b`); A starts
as PEFT initialises it (kaiming-uniform, bound 1 / sqrt(in)) and B at 0, so a fresh adapter is the
base model exactly. A takes the base kernel's input logical axis and B its output axis, so the
adapters shard like the weight they adapt. `set_enabled(model, False)` runs the same model with its
adapters off (the KL reference, no second copy of the base); `merge` folds them into the base
weights (what the rollout engine and `ckpt export-hf` get).

Adapters live in plain nested dicts beside the base's (`nnx.to_pure_dict` paths): the Trainer's
params and optimiser state are those dicts only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

# target name -> (module under a decoder layer, projection)
TARGETS = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}


class LoRAParam(nnx.Param):
    """An adapter matrix: a Param (trained, saved), told apart from the frozen base by its type."""


def parse_targets(text: str) -> tuple[str, ...]:
    """'all' or a comma-separated subset of TARGETS, in TARGETS' order; ValueError names the bad one."""
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if names == ["all"]:
        return tuple(TARGETS)
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown target {unknown[0] if unknown else text!r}; allowed: all or {','.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float = 32.0
    targets: tuple[str, ...] = tuple(TARGETS)
    seed: int = 0
    base: dict | None = None  # fingerprint of the frozen base (`base_fingerprint`), recorded in checkpoints

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        """PEFT's target_modules: the projection names."""
        return [TARGETS[t][1] for t in self.targets]


def target_linears(model, targets):
    """(layer index, target, Linear) of every adapted projection."""
    for i, layer in enumerate(model.layers):
        for t in targets:
            parent, proj = TARGETS[t]
            yield i, t, getattr(getattr(layer, parent), proj)


def check_rank(model_cfg, lora: LoRAConfig) -> None:
    """ValueError naming the target when the rank exceeds min(in, out) of its projection."""
    M, I = model_cfg.hidden_size, model_cfg.intermediate_size
    q, kv = model_cfg.num_attention_heads * model_cfg.head_dim, model_cfg.num_key_value_heads * model_cfg.head_dim
    dims = {"q": (M, q), "k": (M, kv), "v": (M, kv), "o": (q, M), "gate": (M, I), "up": (M, I), "down": (I, M)}
    for t in lora.targets:
        if lora.rank > min(dims[t]):
            raise ValueError(
                f"model.lora_rank={lora.rank} exceeds target {t!r} ({TARGETS[t][1]} is {dims[t][0]} -> {dims[t][1]}: "
                f"rank at most {min(dims[t])})"
            )


def add_adapters(model, lora: LoRAConfig, mesh=None):
    """Attach fresh adapters to `model`'s target projections (in place); returns `model`."""
    check_rank(model.cfg, lora)
    key = jax.random.key(lora.seed)
    for i, t, linear in target_linears(model, lora.targets):
        out_dim, in_dim = linear.weight[...].shape
        out_axis, in_axis = linear.weight.get_metadata()["logical_axes"]
        bound = 1.0 / math.sqrt(in_dim)  # torch's kaiming_uniform_(a=sqrt(5)) on [r, in], as PEFT
        key_it = jax.random.fold_in(jax.random.fold_in(key, i), list(TARGETS).index(t))
        a = jax.random.uniform(key_it, (in_dim, lora.rank), jnp.float32, -bound, bound)
        b = jnp.zeros((lora.rank, out_dim), jnp.float32)
        if mesh is not None:
            from april_jax.models.sharding import logical_sharding

            a = jax.device_put(a, logical_sharding((in_axis, None), a.shape, mesh))
            b = jax.device_put(b, logical_sharding((None, out_axis), b.shape, mesh))
        linear.lora_a = nnx.data(LoRAParam(a, logical_axes=(in_axis, None)))  # None was static
        linear.lora_b = nnx.data(LoRAParam(b, logical_axes=(None, out_axis)))
        linear.lora_scale = float(lora.scale)
    return model


def set_enabled(model, enabled: bool):
    """Turn every adapter on or off (a static flag: a graphdef split after it keeps it); returns `model`."""
    for _, _, linear in target_linears(model, TARGETS):
        if linear.lora_a is not None:
            linear.lora_enabled = bool(enabled)
    return model


def adapter_paths(adapters: dict, prefix=()):
    """Paths (as in the pure dict) of the modules holding `lora_a`/`lora_b`."""
    if "lora_a" in adapters:
        yield prefix
        return
    for k, v in adapters.items():
        if isinstance(v, dict):
            yield from adapter_paths(v, prefix + (k,))


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def merge(base: dict, adapters: dict, scale: float) -> dict:
    """The base's pure dict with each adapted weight replaced by W + scale (A B)^T, in W's dtype
    (summed in fp32). Traceable; the base's other leaves are returned as they are."""
    out = jax.tree.map(lambda x: x, base)
    for path in adapter_paths(adapters):
        node, ad = _get(out, path), _get(adapters, path)
        w = node["weight"]
        delta_OI = (ad["lora_a"].astype(jnp.float32) @ ad["lora_b"].astype(jnp.float32)).T * scale
        node["weight"] = (w.astype(jnp.float32) + delta_OI).astype(w.dtype)
    return out


def peft_tensors(adapters: dict) -> dict:
    """{PEFT key: numpy array} of an adapter dict: lora_A.weight [r, in], lora_B.weight [out, r]."""
    import numpy as np

    out = {}
    for path in adapter_paths(adapters):
        layer, parent, proj = path[-3:]
        assert path[0] == "layers", path
        ad = _get(adapters, path)
        name = f"base_model.model.model.layers.{int(layer)}.{parent}.{proj}"
        out[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(ad["lora_a"], np.float32).T)
        out[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(ad["lora_b"], np.float32).T)
    return out


def peft_config(lora_cfg: dict, base_name: str) -> dict:
    """adapter_config.json for PEFT's LoraConfig (no dropout, no bias: what was trained)."""
    targets = parse_targets(lora_cfg["lora_targets"])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora_cfg["lora_rank"]),
        "lora_alpha": float(lora_cfg["lora_alpha"]),
        "target_modules": [TARGETS[t][1] for t in targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_name,
    }


# Bytes of each end of a safetensors file read into its fingerprint: the header (names, shapes,
# dtypes) and the first and last tensors' bytes tell a fine-tuned sibling apart at any size, where
# hashing the whole of a multi-GB checkpoint would cost a read of it at every resume. mtimes would
# break on an honest copy of the same files.
FINGERPRINT_BYTES = 1 << 20


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            f.seek(max(size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
            h.update(f.read())
    return h.hexdigest()[:16]


def base_source(config: dict) -> tuple[str, str | int]:
    """Where a LoRA run's frozen base comes from: ("path", dir) for model.path or, after a
    supervised warm-up, the warmed-up model saved to WORKDIR/lora_base; ("init", seed) for a
    random model of model.arch rebuilt from the seed."""
    model = config.get("model", {})
    if model.get("path"):
        return "path", str(model["path"])
    if (config.get("warmup") or {}).get("steps"):
        return "path", str(Path(config.get("workdir", ".")) / "lora_base")
    return "init", int(config.get("seed", 0))


def base_fingerprint(config: dict) -> dict:
    """What identifies the base: its safetensors files (name, size, digest of their ends), or the
    architecture and seed of a random one."""
    kind, where = base_source(config)
    if kind == "init":
        return {"init": {"arch": config.get("model", {}).get("arch"), "seed": where}}
    files = sorted(Path(where).glob("*.safetensors"))
    return {"files": [[f.name, f.stat().st_size, _file_digest(f)] for f in files]}


def fingerprint_change(recorded: dict | None, config: dict) -> str | None:
    """Why the base of `config` is not the one `recorded`, or None (also when nothing was recorded)."""
    if not recorded:
        return None
    now = base_fingerprint(config)
    if now == recorded:
        return None
    kind, where = base_source(config)
    what = f"its safetensors files in {where}" if kind == "path" else "a random model of model.arch and the seed"
    return f"the LoRA base ({what}) differs from the one the run started from (recorded: {json.dumps(recorded)[:200]})"
