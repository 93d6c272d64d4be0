"""Orbax checkpoints of a training run: WORKDIR/checkpoints/STEP/{params,opt_state,meta}.

`meta` (JSON) holds step, policy version, RNG state, data position, the APRIL partial buffer,
the resolved config and the model's Hugging Face config. Orbax writes each step to a temporary
directory and renames it when complete, so a killed process never leaves a half checkpoint;
saving is asynchronous and `close()` waits for the last one.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from april_jax.runtime import distributed
from april_jax.runtime.errors import CheckpointError

# What the trainer and `ckpt` read from a checkpoint's meta.
META_KEYS = ("step", "version", "skipped_steps", "data", "april", "model_config")
INT_META_KEYS = ("step", "version", "skipped_steps")
# Config keys whose value is built into what a checkpoint holds: the buffered groups' size
# (n_samples_per_prompt), the prompts' tokens (task) and the adapters' shapes (LoRA). The model's
# shapes are compared on its Hugging Face config, whatever set them (model.arch, model.tiny.*,
# model.path).
SHAPE_KEYS = ("rollout.n_samples_per_prompt", "data.task", "model.lora_rank", "model.lora_targets")
MODEL_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def meta_problem(meta) -> str | None:
    """What is wrong with a checkpoint meta (missing keys, a step that is not a number), or None."""
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        return f"its meta lacks {', '.join(missing)}"
    wrong = [f"{k}={meta[k]!r}" for k in INT_META_KEYS if type(meta[k]) is not int or meta[k] < 0]
    return f"its meta has {', '.join(wrong)} (expected whole numbers >= 0)" if wrong else None


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


# Keys that change what the adapters in a LoRA checkpoint mean without changing their shapes:
# resumed with another lora_alpha, the same A and B would scale the update by another factor.
LORA_MEANING_KEYS = ("model.lora_alpha",)


def _normalised(key: str, value):
    """`value` as compared: the same targets however written ('all' is the seven projections)."""
    if key == "model.lora_targets" and value is not None:
        from april_jax.models.lora import parse_targets

        try:
            return ",".join(parse_targets(value))
        except ValueError:
            return value
    if key in LORA_MEANING_KEYS and isinstance(value, int | float):
        return float(value)
    return value


def shape_changes(meta: dict, config: dict, model_config: dict) -> list[str]:
    """`key: checkpoint value -> this run's value` for each shape-defining key that differs (and,
    in a LoRA run, each key that changes what its adapters mean)."""
    changed = []
    recorded = meta.get("config") or {}
    lora = _lookup(recorded, "model.lora_rank") or _lookup(config, "model.lora_rank")
    for key in SHAPE_KEYS + (LORA_MEANING_KEYS if lora else ()):
        old, new = _lookup(recorded, key), _lookup(config, key)
        if old is not None and _normalised(key, old) != _normalised(key, new):
            changed.append(f"{key}: {old!r} -> {new!r}")
    for key in MODEL_SHAPE_KEYS:
        old, new = (meta.get("model_config") or {}).get(key), model_config.get(key)
        if old is not None and new is not None and old != new:
            changed.append(f"model {key}: {old!r} -> {new!r}")
    return changed


def _abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
        )
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _not_a_background_traceback(record) -> bool:
    """orbax logs each failure of its background save threads with a traceback (hundreds of lines
    for one full disk), and asyncio logs the tensorstore writes whose futures nobody awaited after
    that; orbax then raises the same error in the caller, which reports it once."""
    if not record.exc_info or record.exc_info[1] is None:
        return True
    if record.name == "asyncio":
        return "OCDBT" not in str(record.exc_info[1])  # a tensorstore write of a checkpoint
    return "/orbax/" not in record.pathname.replace("\\", "/")


def _closed_loop_echo(kind, value) -> bool:
    """A failed background save closes orbax's event loop while tensorstore still completes the
    writes it had started; each completion then reports "Event loop is closed" (as an unraisable
    error, a traceback each). The save's own error reaches the caller: only those echoes are dropped."""
    return kind is RuntimeError and str(value) == "Event loop is closed"


def _quiet_unraisable_hook(previous):
    def hook(unraisable):
        if not _closed_loop_echo(unraisable.exc_type, unraisable.exc_value):
            previous(unraisable)

    hook.quiets_closed_loops = True
    return hook


def _quiet_excepthook(previous):
    def hook(kind, value, tb):
        if not _closed_loop_echo(kind, value):
            previous(kind, value, tb)

    hook.quiets_closed_loops = True
    return hook


class Checkpointer:
    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        import logging
        import sys

        for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
            if _not_a_background_traceback not in logger.filters:
                logger.addFilter(_not_a_background_traceback)
        if not getattr(sys.excepthook, "quiets_closed_loops", False):
            sys.excepthook = _quiet_excepthook(sys.excepthook)
        if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
            sys.unraisablehook = _quiet_unraisable_hook(sys.unraisablehook)
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def check_resumable(self, config: dict, model_config: dict) -> None:
        """Fail with one line naming the keys when the newest checkpoint whose meta reads was written
        with other shapes than this run's: restoring would fail deep in orbax (a changed model), or
        succeed and carry groups of the old size into a batch that no longer divides (a changed
        n_samples_per_prompt), or, in a LoRA run, silently rescale the adapters (another
        lora_alpha). Unreadable checkpoints are left to `restore_latest`."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = read_meta(self.directory / str(step))
            except CheckpointError:
                continue
            changed = shape_changes(meta, config, model_config)
            if changed:
                raise CheckpointError(
                    f"{self.directory / str(step)} was written by a run with other shapes or LoRA settings "
                    f"({'; '.join(changed)}): "
                    f"resume with the checkpoint's values, or start a new run in another --config.workdir"
                )
            # A checkpoint of LoRA adapters means nothing on another base: their shapes may match.
            from april_jax.models.lora import fingerprint_change

            why = fingerprint_change((meta.get("lora") or {}).get("base"), config)
            if why:
                raise CheckpointError(
                    f"{self.directory / str(step)}: {why}; resume on the same base, or start a new run in "
                    f"another --config.workdir"
                )
            return

    def restore_latest(self, params_like, opt_state_like, param_shardings=None, opt_shardings=None, log=print):
        """(step, params, opt_state, meta) of the newest checkpoint that restores and is finite, or None.

        Newer unreadable ones (an empty or corrupt directory, non-finite params) are moved to
        checkpoints.unreadable/ (kept, not deleted) with one line through `log`, so that the run
        continues from the newest valid one and can save those steps again. If none restores, the
        newest one's error is raised and nothing is moved (a changed model config fails every
        checkpoint: that is not corruption).
        """
        bad: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                with _quiet_abandoned_reads():
                    params, opt_state, meta = self.restore(
                        step, params_like, opt_state_like, param_shardings, opt_shardings
                    )
                problem = meta_problem(meta)
                if problem:
                    raise CheckpointError(problem)
                if not all_finite(params) or not all_finite(opt_state):
                    raise CheckpointError("non-finite parameters or optimiser state")
            except Exception as e:  # tensorstore, orbax, JSON and key errors alike: the directory is unusable
                bad.append((step, f"{type(e).__name__}: {_first_line(e)}"))
                continue
            if bad and distributed.is_main():  # several processes share the directory: one moves
                for bad_step, why in bad:
                    moved = self._set_aside(bad_step)
                    log(
                        f"warning: checkpoint {self.directory / str(bad_step)} is unreadable ({why}); moved to "
                        f"{moved}; resuming from step {step}"
                    )
            if bad:
                distributed.barrier("checkpoints set aside")
                self.manager.reload()
            return step, params, opt_state, meta
        if bad:
            raise CheckpointError(
                f"{self.directory / str(bad[0][0])}: cannot restore ({bad[0][1]}) and no older "
                f"checkpoint restores either"
            )
        return None

    def _set_aside(self, step: int) -> Path:
        target_dir = self.directory.parent / (self.directory.name + ".unreadable")
        target_dir.mkdir(exist_ok=True)
        target = target_dir / str(step)
        n = 1
        while target.exists():
            target, n = target_dir / f"{step}.{n}", n + 1
        (self.directory / str(step)).rename(target)
        return target

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        if not all_finite(params) or not all_finite(opt_state):  # never replace good checkpoints by NaNs
            raise CheckpointError(f"refusing to save checkpoint {step}: non-finite parameters or optimiser state")
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def write_now(self, meta: dict | None, params, opt_state, written: int | None):
        """Write the checkpoint of `meta["step"]` unless that is `written` (the step saved last) and wait
        until it is on disk; the step a checkpoint now holds (`written` when nothing was saved). Every
        process calls it (the save is collective)."""
        if meta is not None and meta["step"] != written:
            self.save(meta["step"], params, opt_state, meta)
            written = meta["step"]
        self.manager.wait_until_finished()
        return written

    def restore(self, step: int, params_like, opt_state_like, param_shardings=None, opt_shardings=None):
        """(params, opt_state, meta), placed like `*_like` (or on the given shardings)."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like, param_shardings)),
                opt_state=ocp.args.StandardRestore(_abstract(opt_state_like, opt_shardings)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], out["opt_state"], out["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def all_finite(tree) -> bool:
    """True if every float leaf of `tree` is finite (one reduction per leaf, on device)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return (
        bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves)) if leaves else True
    )


@contextlib.contextmanager
def _quiet_abandoned_reads():
    """A damaged checkpoint fails one of orbax's concurrent array reads; the others' coroutines are
    dropped with their exceptions unread, which Python reports at garbage collection as
    'Exception ignored in: <coroutine ...>' with a traceback and TensorStore's spec (~130 lines).
    The failure itself is reported in one line by the caller: those echoes are muted here."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not inspect.iscoroutine(unraisable.object):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        gc.collect()  # the dropped coroutines go now, while the hook is ours
        sys.unraisablehook = previous


def _first_line(e: BaseException) -> str:
    """The reason in one short line: TensorStore appends its whole spec (a bound method's repr and a
    multi-line JSON) after "See full TensorStore details", which says nothing to the user."""
    text = str(e).strip().split("See full TensorStore details")[0].strip().rstrip(".")
    return text.splitlines()[0][:300] if text else repr(e)


def read_meta(step_dir) -> dict:
    """The JSON meta of one checkpoint directory (WORKDIR/checkpoints/STEP), checked for april's keys."""
    import json

    file = Path(step_dir) / "meta" / "metadata"
    if not file.exists():
        raise CheckpointError(f"{step_dir}: not an april_jax checkpoint (no meta/metadata)")
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    problem = meta_problem(meta)
    if problem:
        what = "not an april_jax checkpoint" if "lacks" in problem else "a damaged checkpoint"
        raise CheckpointError(f"{step_dir}: {what} ({problem})")
    return meta


def resolve_step_dir(path) -> Path:
    """PATH may be a step dir, a checkpoints dir (latest step) or a workdir (its latest step)."""
    given = Path(path)
    path = given.absolute()  # orbax reads relative paths as nothing (0 parameters)
    if not path.exists():
        raise CheckpointError(f"{given}: checkpoint not found")
    if (path / "meta").exists():
        return path
    for base in (path, path / "checkpoints"):
        steps = sorted((int(p.name), p) for p in base.glob("*") if p.name.isdigit() and (p / "meta").exists())
        if steps:
            return steps[-1][1]
    raise CheckpointError(f"{given}: no checkpoint in it")
