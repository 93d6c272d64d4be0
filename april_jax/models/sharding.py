"""Device mesh and the logical-axis -> mesh-axis rules table.

Every parameter carries `logical_axes` metadata (one name per dimension). The single table
`LOGICAL_AXIS_RULES` says which mesh axis (or axes) each logical name is split over. A dimension
whose size is not divisible by its mesh axes is replicated instead, so small test models and
odd head counts still load on any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis, tuple of mesh axes, or None (replicated)
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",  # num_heads * head_dim, the output of q_proj / input of o_proj
    "kv_heads": "tensor",  # num_kv_heads * head_dim
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
}


def make_mesh(axes: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over `devices` (default: all) with axes data/fsdp/tensor; one size may be -1 (the rest)."""
    axes = dict(axes or {"data": 1, "fsdp": -1, "tensor": 1})
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axis {sorted(unknown)}; valid axes are {MESH_AXES}")
    devices = list(devices if devices is not None else jax.devices())
    sizes = [int(axes.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {axes}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh: axis sizes must be positive or -1, got {axes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices not divisible by fixed axes {axes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh: axes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, have {len(devices)}"
        )
    device_grid = np.asarray(devices).reshape(sizes)
    return Mesh(device_grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _mesh_size(mesh: Mesh, mesh_axes) -> int:
    if mesh_axes is None:
        return 1
    names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    return math.prod(mesh.shape[n] for n in names)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for an array of `shape` whose dims are named `logical_axes`."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    spec, used = [], set()
    for name, size in zip(logical_axes, shape):
        mesh_axes = LOGICAL_AXIS_RULES.get(name) if name is not None else None
        names = () if mesh_axes is None else ((mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes))
        names = tuple(n for n in names if n not in used and mesh.shape.get(n, 1) > 1)
        if not names or size % _mesh_size(mesh, names):
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return P(*spec)


def logical_sharding(logical_axes, shape, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh))


def state_shardings(state: nnx.State, mesh: Mesh):
    """A pytree of NamedShardings matching `state`, from each variable's `logical_axes`."""

    def one(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            return NamedSharding(mesh, P())
        return logical_sharding(axes, value.shape, mesh)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move every parameter of `model` onto its mesh sharding (in place), and return it."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    values = jax.tree.map(lambda v: v.get_value(), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placed = jax.device_put(values, shardings)
    nnx.update(model, placed)
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch-major arrays split over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))
