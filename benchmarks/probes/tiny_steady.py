"""Steady-state rollout seconds per step of a short tiny run (no eval), compiles taken out.

    python -m benchmarks.probes.tiny_steady NAME [--config.x=value ...]

Trains `configs/tiny.py` for 14 steps (persistent compile cache off) in /tmp/tiny_steady/NAME and prints one JSON line: the
median and mean over steps 2-13 of `time/rollout_s - time/rollout_compile_s`, the compile seconds,
prefill tokens, device calls (`rollout/model_calls`), host overhead, aborts and reward per step.
The synchronous baseline: `--config.rollout.partial_rollout=false --config.rollout.over_sampling_batch_size=16`.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    name, overrides = sys.argv[1], sys.argv[2:]
    workdir = Path("/tmp/tiny_steady") / name
    shutil.rmtree(workdir, ignore_errors=True)
    t = time.time()
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        "--config.train.total_steps=14",
        "--config.eval.every=0",
        "--config.log.progress=false",
        "--config.log.tensorboard=false",
        "--config.train.compile_cache_dir=",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode:
        sys.exit(proc.stderr[-2000:])
    # steps 0-1 meet most shapes
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")][2:]
    steady = [r["time/rollout_s"] - r["time/rollout_compile_s"] for r in rows]
    mean = lambda key: statistics.mean(r.get(key, 0) for r in rows)
    print(
        json.dumps(
            {
                "name": name,
                "overrides": overrides,
                "wall_s": round(time.time() - t, 1),
                "steady_median_s": round(statistics.median(steady), 4),
                "steady_mean_s": round(statistics.mean(steady), 4),
                "compile_s": round(sum(r["time/rollout_compile_s"] for r in rows), 2),
                "prefill_tokens": mean("rollout/prefill_tokens"),
                "model_calls": mean("rollout/model_calls"),
                "host_overhead_s": round(statistics.median(r.get("rollout/host_overhead_s", 0) for r in rows), 4),
                "aborted": mean("rollout/aborted"),
                "reward": round(mean("reward/mean"), 3),
                "loadavg": open("/proc/loadavg").read().split()[:3],
            }
        )
    )


if __name__ == "__main__":
    main()
