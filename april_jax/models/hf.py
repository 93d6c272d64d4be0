"""Hugging Face checkpoints <-> the NNX Qwen3: the name table, loading onto a mesh, saving.

This module depends on `qwen3` (the model), never the other way round: load with
`hf.from_pretrained`, save with `hf.save_pretrained`.

Loading builds the model abstractly (no memory), then creates every parameter with
`jax.make_array_from_callback`, so each device receives only its own shard, sliced straight
out of the memory-mapped safetensors file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from april_jax.models.qwen3 import Qwen3, Qwen3Config
from april_jax.models.safetensors_io import CheckpointError, SafetensorsDir, save_file
from april_jax.models.sharding import logical_sharding

log = logging.getLogger(__name__)

# NNX parameter path (with "{i}" for the layer index) -> Hugging Face tensor name.
NAME_TABLE: dict[tuple[str, ...], str] = {
    ("embed_tokens",): "model.embed_tokens.weight",
    ("layers", "{i}", "input_layernorm", "weight"): "model.layers.{i}.input_layernorm.weight",
    ("layers", "{i}", "self_attn", "q_proj", "weight"): "model.layers.{i}.self_attn.q_proj.weight",
    ("layers", "{i}", "self_attn", "q_proj", "bias"): "model.layers.{i}.self_attn.q_proj.bias",
    ("layers", "{i}", "self_attn", "k_proj", "weight"): "model.layers.{i}.self_attn.k_proj.weight",
    ("layers", "{i}", "self_attn", "k_proj", "bias"): "model.layers.{i}.self_attn.k_proj.bias",
    ("layers", "{i}", "self_attn", "v_proj", "weight"): "model.layers.{i}.self_attn.v_proj.weight",
    ("layers", "{i}", "self_attn", "v_proj", "bias"): "model.layers.{i}.self_attn.v_proj.bias",
    ("layers", "{i}", "self_attn", "o_proj", "weight"): "model.layers.{i}.self_attn.o_proj.weight",
    ("layers", "{i}", "self_attn", "o_proj", "bias"): "model.layers.{i}.self_attn.o_proj.bias",
    ("layers", "{i}", "self_attn", "q_norm", "weight"): "model.layers.{i}.self_attn.q_norm.weight",
    ("layers", "{i}", "self_attn", "k_norm", "weight"): "model.layers.{i}.self_attn.k_norm.weight",
    ("layers", "{i}", "post_attention_layernorm", "weight"): "model.layers.{i}.post_attention_layernorm.weight",
    ("layers", "{i}", "mlp", "gate_proj", "weight"): "model.layers.{i}.mlp.gate_proj.weight",
    ("layers", "{i}", "mlp", "up_proj", "weight"): "model.layers.{i}.mlp.up_proj.weight",
    ("layers", "{i}", "mlp", "down_proj", "weight"): "model.layers.{i}.mlp.down_proj.weight",
    ("norm", "weight"): "model.norm.weight",
    ("lm_head",): "lm_head.weight",
}
# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(path: tuple) -> str:
    """Hugging Face name of the NNX parameter at `path` (e.g. ('layers', 3, 'mlp', ...))."""
    key = tuple("{i}" if isinstance(p, int) else str(p) for p in path)
    if key not in NAME_TABLE:
        raise KeyError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")
    layer = next((p for p in path if isinstance(p, int)), None)
    return NAME_TABLE[key].format(i=layer)


def named_params(model: Qwen3) -> dict[str, jax.Array]:
    """{hf_name: array} for every parameter of `model` (no copies)."""
    state = nnx.state(model, nnx.Param)
    return {hf_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def read_config(path) -> dict:
    file = Path(path) / "config.json"
    if not file.exists():
        raise CheckpointError(f"{file}: not found (a Hugging Face checkpoint directory needs config.json)")
    try:
        out = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return out


def from_pretrained(path, *, dtype=jnp.float32, mesh: Mesh | None = None, compute_dtype=None, **overrides) -> Qwen3:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) onto `mesh`: parameters
    in `dtype`, computation in `compute_dtype` (default: `dtype`); `overrides` set Qwen3Config fields
    that config.json does not carry (e.g. remat="full")."""
    param_dtype, dtype = dtype, compute_dtype or dtype
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    try:
        cfg = Qwen3Config.from_hf_config(read_config(path), param_dtype=param_dtype, dtype=dtype, **overrides)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        why = str(e).removeprefix("config.json: ") if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{path / 'config.json'}: {why}") from None
    files = SafetensorsDir(path)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, state = nnx.split(abstract)
    used = set()
    for param_path, var in nnx.to_flat_state(state):
        name = hf_name(param_path)
        expected = var.get_value()
        if name not in files:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        if files.shape(name) != tuple(expected.shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {files.shape(name)}, expected {tuple(expected.shape)}"
            )
        used.add(name)
        sharding = logical_sharding(var.get_metadata()["logical_axes"], expected.shape, mesh) if mesh else None
        target = np.dtype(expected.dtype)

        def shard(index, name=name, target=target):
            # `read` returns a fresh array, not a view of the memory map (device buffers aliasing
            # the map made decoding ~2x slower on CPU): only a dtype change copies here.
            return np.asarray(files.read(name, index), dtype=target)

        if mesh is None:
            # Uncommitted, like freshly initialised params: committed single-device arrays add
            # sharding annotations that compiled to a ~1.5x slower decode step on CPU.
            var.set_value(jnp.asarray(shard(...)))
        else:
            var.set_value(jax.make_array_from_callback(tuple(expected.shape), sharding, shard))
    unused = [
        n
        for n in files.keys()
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if unused:
        log.warning("%s: %d tensors not used by the model, e.g. %s", path, len(unused), unused[:3])
    return nnx.merge(graphdef, state)


def save_pretrained(model: Qwen3, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """config.json + model.safetensors (or numbered shards + index when larger than max_shard_bytes).

    Each file is written to a temporary name and renamed; config.json is written last, so a
    directory without it is an interrupted save.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.asarray(jax.device_get(a)) for name, a in named_params(model).items()}
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    stale = list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json"))
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors")
        written = {path / "model.safetensors"}
    else:
        weight_map, written = {}, set()
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / file)
            written.add(path / file)
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
        _write_text_atomic(path / "model.safetensors.index.json", json.dumps(index, indent=2))
        written.add(path / "model.safetensors.index.json")
    for old in stale:
        if old not in written:
            old.unlink()
    _write_text_atomic(path / "config.json", json.dumps(model.cfg.to_hf_config(), indent=2))


def _write_text_atomic(file: Path, text: str) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, file)
