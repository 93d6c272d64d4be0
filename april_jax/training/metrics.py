"""Per-step metrics: one JSON object per line in WORKDIR/metrics.jsonl, the same names (exactly:
`eval/avg@2` stays `eval/avg@2`) to TensorBoard (tensorboardX) and, when `log.wandb_project` is set,
to Weights & Biases; plus a one-line console progress report."""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from pathlib import Path


class _TensorBoard:
    """Scalars under their own names: tensorboardX's `add_scalar` rewrites tags outside
    [-/\\w.] (`eval/avg@2` -> `eval/avg_2`), so the Summary proto is written directly."""

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(logdir))

    def write(self, step: int, record: dict) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in record.items() if k != "step"]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """A W&B run in WORKDIR/wandb; a resumed training run continues the same W&B run (its id is
    kept in WORKDIR/wandb_run_id)."""

    def __init__(self, workdir: Path, project: str, mode: str, config: dict | None):
        try:
            import wandb
        except ImportError:
            from april_jax.config import ConfigError

            raise ConfigError(
                "log.wandb_project is set but wandb is not installed "
                "(pip install 'april_jax[wandb]' or pip install wandb)"
            ) from None
        id_file = workdir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project,
            mode=mode,
            dir=str(workdir),
            id=run_id,
            resume="allow",
            config=config or {},
            name=workdir.name,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def write(self, step: int, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    def __init__(
        self,
        workdir,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        wandb_project: str = "",
        wandb_mode: str = "online",
        config: dict | None = None,
    ):
        workdir = Path(workdir)
        self.path = workdir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress, self.total_steps = progress, total_steps
        self._t0, self._first_step = time.perf_counter(), None
        self._sinks = []
        if tensorboard:
            try:
                self._sinks.append(_TensorBoard(workdir / "tensorboard"))
            except ImportError:
                pass
        if wandb_project and wandb_mode != "disabled":
            self._sinks.append(_Wandb(workdir, wandb_project, wandb_mode, config))

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for sink in self._sinks:
            sink.write(step, scalars)
        if self.progress:
            self._report(step, record)

    def _report(self, step: int, m: dict) -> None:
        if self._first_step is None:
            self._first_step, self._t0 = step, time.perf_counter()
        done = step - self._first_step + 1
        per_step = (time.perf_counter() - self._t0) / done
        left = max(self.total_steps - step - 1, 0) * per_step
        bar_len = 20
        filled = int(bar_len * (step + 1) / max(self.total_steps, 1))
        print(
            f"[{'#' * filled}{'.' * (bar_len - filled)}] step {step + 1}/{self.total_steps} "
            f"reward {m.get('reward/mean', float('nan')):.3f} "
            f"tok/s {m.get('rollout/tokens_per_s', 0):.0f} "
            f"loss {m.get('train/loss', float('nan')):+.4f} ETA {left / 60:.1f} min",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class MetricsError(ValueError):
    """A metrics.jsonl line that is not a JSON object (not the last one: that one may be torn)."""


def read_metrics(workdir, torn: list | None = None) -> list[dict]:
    """The rows of WORKDIR/metrics.jsonl. A last line that does not parse was torn by a kill
    mid-write: it is left out (and its line number appended to `torn`); a bad line before it
    raises MetricsError naming the file and line."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not an object with an integer step")
        except ValueError as e:
            if n == len(lines) - 1:
                if torn is not None:
                    torn.append(i)
                break
            raise MetricsError(f"{path}:{i}: not a metrics record ({str(e).splitlines()[0][:80]})") from None
        rows.append(row)
    return rows


def truncate_log(file: Path, keep_below: int) -> None:
    """Keep only lines of steps < keep_below: a resumed run re-does later steps. A torn last line
    (the process was killed mid-write) is dropped."""
    if not file.exists():
        return
    kept = []
    for line in file.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] < keep_below:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    file.write_text("".join(l + "\n" for l in kept))
