"""APRIL vs the synchronous baseline, trained end to end, back to back on the same machine.

    python -m benchmarks.april_vs_sync --config configs/tiny.py --seeds 0,1,2 [--config.x=value ...]

For every seed: one APRIL run (the config as given) then one synchronous run (the same config
with `rollout.partial_rollout=false` and `rollout.over_sampling_batch_size=rollout_batch_size`),
each a fresh `python -m april_jax.train` process in its own workdir under `--out`, with the persistent
compile cache off (`train.compile_cache_dir=`: every run compiles cold, so compile seconds and wall
times compare). Any
`--config.x=value` is passed to both. Prints one JSON line per run, then one overall JSON object:

- `rollout_time_ratio`: median over seeds of (APRIL's median `time/rollout_s` per step) / (sync's);
  `rollout_time_ratio_steady` the same without the XLA compiles inside each rollout
  (`time/rollout_compile_s`: in a short run they land in the steps that meet a new shape first);
- `wall_s`, `median_rollout_s`, `median_train_s` per run;
- reward (mean `reward/mean` over the first and last 20% of steps) and greedy `eval/accuracy` at
  every eval step (both modes evaluate at the same steps), its first -> last gain;
- `seconds_to_reward`: `time/elapsed_s` when the 10-step moving average of the training reward
  first reaches `--reward-threshold` (null if never);
- the load average (`/proc/loadavg`) before and after every run, and the run's CPU seconds
  (`cpu_s`, user + system of the training process): timings on a shared machine drift, CPU
  seconds much less.

`--reuse` summarizes runs already in `--out` (their `benchmark_run.json`) instead of training them
again: seeds can be trained by separate invocations (in parallel) and summarized together.
`--modes april` trains APRIL only and compares each seed with a sync run an earlier invocation left
in `--out` (seeds without one are reported alone).

and writes a PNG (`--png`, default `april_vs_sync.png` in `--out`) of training reward and eval
accuracy vs wall-clock seconds, both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from april_jax.config.loading import load_config
from april_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

MOVING = 10  # steps in the reward moving average for seconds_to_reward


def moving_mean(reward: np.ndarray) -> tuple[np.ndarray, int]:
    """The reward's moving average over MOVING steps (all of them in a shorter run) and its window:
    entry i ends at step i + window - 1."""
    window = max(1, min(MOVING, len(reward)))
    return np.convolve(reward, np.ones(window) / window, mode="valid"), window


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def train(config: str, workdir: Path, overrides: list[str]) -> dict:
    """Runs one training process from scratch; its wall and CPU seconds and the load around it
    (also written to WORKDIR/benchmark_run.json, which `--reuse` reads)."""
    if workdir.exists():
        shutil.rmtree(workdir)
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        config,
        f"--config.workdir={workdir}",
        "--config.log.progress=false",
        "--config.log.tensorboard=false",
        "--config.train.compile_cache_dir=",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = loadavg()
    t, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"error: training failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    timing = {
        "wall_s": wall,
        "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
        "loadavg_before": before,
        "loadavg_after": loadavg(),
    }
    (workdir / "benchmark_run.json").write_text(json.dumps(timing))
    return timing


def summarize(rows: list[dict], threshold: float) -> dict:
    steps = len(rows)
    fifth = max(steps // 5, 1)
    reward = np.array([r["reward/mean"] for r in rows])
    evals = [(r["step"], r["eval/version"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    moving, window = moving_mean(reward)
    reached = np.flatnonzero(moving >= threshold)
    at = int(reached[0]) + window - 1 if len(reached) else None
    rollout_s = [r["time/rollout_s"] for r in rows[1:]]  # step 0 pays the compiles
    # without the XLA compiles of engine programs met for the first time (a long run's steady state)
    steady_s = [r["time/rollout_s"] - r.get("time/rollout_compile_s", 0.0) for r in rows[1:]]
    return {
        "steps": steps,
        "median_rollout_s": statistics.median(rollout_s),
        "median_rollout_steady_s": statistics.median(steady_s),
        "rollout_compile_s": float(sum(r.get("time/rollout_compile_s", 0.0) for r in rows)),
        "total_rollout_s": float(sum(rollout_s)),
        "median_train_s": statistics.median(r["time/train_s"] for r in rows[1:]),
        "elapsed_s": rows[-1]["time/elapsed_s"],
        "reward_first_20pct": float(reward[:fifth].mean()),
        "reward_last_20pct": float(reward[-fifth:].mean()),
        "eval_accuracy": [{"step": s, "version": v, "accuracy": a} for s, v, a in evals],
        "eval_first": evals[0][2] if evals else None,
        "eval_last": evals[-1][2] if evals else None,
        "eval_gain": evals[-1][2] - evals[0][2] if evals else None,
        "seconds_to_reward": rows[at]["time/elapsed_s"] if at is not None else None,
        "steps_to_reward": at,
        "occupancy_mean": float(np.mean([r["rollout/occupancy"] for r in rows])),
        "response_len_mean": float(np.mean([r["rollout/response_len/mean"] for r in rows])),
        "aborted_per_step": float(np.mean([r["rollout/aborted"] for r in rows])),
        "prefill_tokens_per_step": float(np.mean([r.get("rollout/prefill_tokens", 0) for r in rows])),
    }


def spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "min": float(min(values)), "max": float(max(values))}


def plot(runs: list[dict], out: Path, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = {"april": "tab:blue", "sync": "tab:orange"}
    for run in runs:
        rows, mode = run["rows"], run["mode"]
        t = np.array([r["time/elapsed_s"] for r in rows])
        reward = np.array([r["reward/mean"] for r in rows])
        moving, window = moving_mean(reward)
        label = mode if run["seed"] == runs[0]["seed"] else None
        ax_r.plot(t[window - 1 :], moving, color=colors[mode], alpha=0.8, lw=1.2, label=label)
        evals = [(r["time/elapsed_s"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
        ax_e.plot(*zip(*evals), color=colors[mode], alpha=0.8, lw=1.2, marker=".", label=label)
    ax_r.axhline(threshold, color="gray", ls=":", lw=1)
    ax_r.set(xlabel="wall-clock seconds", ylabel=f"training reward ({MOVING}-step mean)", title="reward")
    ax_e.set(xlabel="wall-clock seconds", ylabel="greedy exact-match accuracy", title="held-out eval")
    seeds = sorted({r["seed"] for r in runs})
    fig.suptitle(f"APRIL vs synchronous, seeds {','.join(map(str, seeds))} (one line per seed)", fontsize=10)
    for ax in (ax_r, ax_e):
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--reward-threshold", type=float, default=0.9)  # the warm-up starts near 0.75
    ap.add_argument("--out", default="runs/april_vs_sync", help="workdirs of the runs")
    ap.add_argument("--png", default=None, help="the figure (default: april_vs_sync.png in --out)")
    ap.add_argument("--reuse", action="store_true", help="summarize the finished runs in --out, train none")
    ap.add_argument(
        "--modes", default="april,sync", help="train these modes; the others' finished runs in --out are read"
    )
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        sys.exit(f"error: unknown argument {bad[0]!r} (only --config.x=value overrides pass through)")
    config = str(Path(args.config).resolve())
    c = load_config(["x", "--config", config, *overrides])
    sync = [
        "--config.rollout.partial_rollout=false",
        f"--config.rollout.over_sampling_batch_size={c.rollout.rollout_batch_size}",
    ]
    out = Path(args.out)
    png = Path(args.png) if args.png else out / "april_vs_sync.png"
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode, extra in (("april", []), ("sync", sync)):
            workdir = out / f"{mode}_seed{seed}"
            if args.reuse or mode not in args.modes.split(","):
                if not (workdir / "benchmark_run.json").exists():
                    if args.reuse:
                        sys.exit(f"error: {workdir} holds no finished {mode} run to read (no benchmark_run.json)")
                    # a mode left out of --modes is compared when an earlier invocation trained it
                    print(f"note: no finished {mode} run in {workdir}: seed {seed} is not compared", file=sys.stderr)
                    continue
                timing = json.loads((workdir / "benchmark_run.json").read_text())
            else:
                timing = train(config, workdir, [*overrides, f"--config.seed={seed}", *extra])
            rows = read_metrics(workdir)
            run = {"mode": mode, "seed": seed, **timing, **summarize(rows, args.reward_threshold)}
            print(json.dumps(run), flush=True)
            runs.append({**run, "rows": rows})

    by = {(r["mode"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs if ("april", r["seed"]) in by and ("sync", r["seed"]) in by})
    plot(runs, png, args.reward_threshold)
    if not seeds:
        print(f"note: no seed has both modes in {out}: nothing to compare (figure: {png})", file=sys.stderr)
        return
    ratios = [by["april", s]["median_rollout_s"] / by["sync", s]["median_rollout_s"] for s in seeds]
    steady = [by["april", s]["median_rollout_steady_s"] / by["sync", s]["median_rollout_steady_s"] for s in seeds]
    final = {m: [by[m, s]["eval_last"] for s in seeds] for m in ("april", "sync")}
    gains = {m: [by[m, s]["eval_gain"] for s in seeds] for m in ("april", "sync")}
    # "not below sync within the spread": APRIL's mean final accuracy >= sync's mean minus half sync's range
    within = np.mean(final["april"]) >= np.mean(final["sync"]) - (max(final["sync"]) - min(final["sync"])) / 2
    overall = {
        "config": args.config,
        "seeds": seeds,
        "overrides": overrides,
        "rollout_time_ratio": float(statistics.median(ratios)),
        "rollout_time_ratio_per_seed": ratios,
        "rollout_time_ratio_steady": float(statistics.median(steady)),
        "rollout_time_ratio_steady_per_seed": steady,
        "wall_s": {m: spread([by[m, s]["wall_s"] for s in seeds]) for m in ("april", "sync")},
        "cpu_s": {m: spread([by[m, s]["cpu_s"] for s in seeds]) for m in ("april", "sync")},
        "median_rollout_s": {m: spread([by[m, s]["median_rollout_s"] for s in seeds]) for m in ("april", "sync")},
        "median_rollout_steady_s": {
            m: spread([by[m, s]["median_rollout_steady_s"] for s in seeds]) for m in ("april", "sync")
        },
        "eval_last": {m: spread(final[m]) for m in ("april", "sync")},
        "eval_gain_per_seed": gains,
        "seconds_to_reward": {m: [by[m, s]["seconds_to_reward"] for s in seeds] for m in ("april", "sync")},
        "reward_threshold": args.reward_threshold,
        "goal_rollout_time_ratio_le_0.75": bool(statistics.median(ratios) <= 0.75),
        "goal_april_eval_not_below_sync": bool(within),
        "goal_eval_gain_ge_0.3_every_seed": bool(min(gains["april"]) >= 0.3),
        "loadavg_end": loadavg(),
        "cpus": os.cpu_count(),
        "png": str(png),
    }
    print(json.dumps(overall, indent=1))


if __name__ == "__main__":
    main()
