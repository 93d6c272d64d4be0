"""Per-step metrics: one JSON object per line in WORKDIR/metrics.jsonl, the same names to
TensorBoard (when tensorboardX is installed), and a one-line console progress report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, workdir, *, tensorboard: bool = True, progress: bool = True, total_steps: int = 0):
        self.path = Path(workdir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress, self.total_steps = progress, total_steps
        self._t0, self._first_step = time.perf_counter(), None
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))
            except ImportError:
                pass

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
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
        print(f"[{'#' * filled}{'.' * (bar_len - filled)}] step {step + 1}/{self.total_steps} "
              f"reward {m.get('reward/mean', float('nan')):.3f} "
              f"tok/s {m.get('rollout/tokens_per_s', 0):.0f} "
              f"loss {m.get('train/loss', float('nan')):+.4f} ETA {left / 60:.1f} min", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
