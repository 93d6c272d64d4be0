"""Orbax checkpoints of a training run: WORKDIR/checkpoints/STEP/{params,opt_state,meta}.

`meta` (JSON) holds step, policy version, RNG state, data position, the APRIL partial buffer,
the resolved config and the model's Hugging Face config. Orbax writes each step to a temporary
directory and renames it when complete, so a killed process never leaves a half checkpoint;
saving is asynchronous and `close()` waits for the last one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    pass


def _abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, params_like, opt_state_like, param_shardings=None, opt_shardings=None):
        """(params, opt_state, meta), placed like `*_like` (or on the given shardings)."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params_like, param_shardings)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state_like, opt_shardings)),
            meta=ocp.args.JsonRestore()))
        return out["params"], out["opt_state"], out["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def read_meta(step_dir) -> dict:
    """The JSON meta of one checkpoint directory (WORKDIR/checkpoints/STEP)."""
    import json

    file = Path(step_dir) / "meta" / "metadata"
    if not file.exists():
        raise CheckpointError(f"{step_dir}: not an april_jax checkpoint (no meta/metadata)")
    return json.loads(file.read_text())


def resolve_step_dir(path) -> Path:
    """PATH may be a step dir, a checkpoints dir (latest step) or a workdir (its latest step)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    if (path / "meta").exists():
        return path
    for base in (path, path / "checkpoints"):
        steps = sorted((int(p.name), p) for p in base.glob("*") if p.name.isdigit() and (p / "meta").exists())
        if steps:
            return steps[-1][1]
    raise CheckpointError(f"{path}: no checkpoint in it")
