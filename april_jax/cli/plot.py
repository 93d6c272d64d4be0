"""python -m april_jax.cli.plot RUN [RUN2 ...] [--out FILE] [--smooth 0.6] [--labels a,b]

One dashboard PNG of one or more runs (their WORKDIR/metrics.jsonl), overlaid with one colour per
run: training reward, held-out eval, response length, engine occupancy, off-policy token fraction,
staleness (in policy versions, its own axis), loss, KL, entropy, gradient norm, throughput and the
time of a step split into rollout / train / weight sync / checkpoint. Noisy per-step series are
drawn faint with an exponential moving average on top (`--smooth`, as TensorBoard's slider; 0: off).
A synchronous baseline (config: partial_rollout=false, over_sampling_batch_size=rollout_batch_size)
is drawn dashed and labelled "sync". Default output: RUN/plots/dashboard.png of the first RUN.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from april_jax.cli import prog
from april_jax.training.metrics import MetricsError, read_metrics

# (title, y label, [(metric, legend suffix)], smoothed?, y limits)
PANELS = [
    ("Training reward", "mean reward per step", [("reward/mean", "")], True, None),
    ("Held-out eval", "mean reward (avg@k)", [("eval/avg@*", "")], False, None),
    (
        "Response length",
        "tokens",
        [("rollout/response_len/mean", "mean"), ("rollout/response_len/max", "max")],
        True,
        None,
    ),
    ("Engine occupancy", "busy slots / all slots", [("rollout/occupancy", "")], True, (0, 1.05)),
    ("Off-policy tokens", "fraction of trained tokens", [("rollout/off_policy_token_frac", "")], True, (0, 1.05)),
    (
        "Staleness",
        "policy versions behind",
        [("rollout/staleness_mean", "mean"), ("rollout/staleness_max", "max")],
        False,
        None,
    ),
    ("Policy loss", "loss", [("train/loss", "")], True, None),
    ("KL (behaviour -> current)", "approx. KL", [("train/ppo_kl", "")], True, None),
    ("Entropy", "nats per token", [("train/entropy", "")], True, None),
    ("Gradient norm", "global L2 norm", [("train/grad_norm", "")], True, None),
    ("Rollout throughput", "generated tokens / s", [("rollout/tokens_per_s", "")], True, None),
]
TIME_PARTS = [
    ("time/rollout_s", "rollout"),
    ("time/train_s", "train"),
    ("time/sync_s", "weight sync"),
    ("time/ckpt_s", "checkpoint"),
]


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average (weight 0: the values themselves)."""
    out, last, n = [], 0.0, 0
    for v in values:
        last, n = last * weight + (1 - weight) * v, n + 1
        out.append(last / (1 - weight**n) if weight else v)
    return out


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [
        (r["step"] + 1, float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def is_sync(workdir: Path) -> bool:
    try:
        cfg = json.loads((workdir / "config.json").read_text())["rollout"]
        return not cfg["partial_rollout"] and cfg["over_sampling_batch_size"] == cfg["rollout_batch_size"]
    except (OSError, KeyError, ValueError):
        return False


def draw(runs: list[tuple[str, list[dict], bool]], out: Path, smooth: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(3, 4, figsize=(20, 11.5))
    for ax, (title, ylabel, keys, smoothed, ylim) in zip(axes.flat, PANELS):
        drawn = False
        for i, (label, rows, sync) in enumerate(runs):
            for j, (key, suffix) in enumerate(keys):
                if key.endswith("*"):
                    key = next((k for r in rows for k in r if k.startswith(key[:-1])), key)
                    suffix = suffix or key.split("/")[-1]
                x, y = series(rows, key)
                if not x:
                    continue
                drawn = True
                name = f"{label} {suffix}".strip() if len(runs) > 1 or suffix else label
                # runs differ by colour (sync: dashed); a panel's second metric is thinner and lighter
                style, width, alpha = ("--" if sync else "-"), (1.8 if j == 0 else 1.0), (1.0 if j == 0 else 0.6)
                color = colors[i % len(colors)]
                if smoothed and smooth and len(x) > 2:
                    ax.plot(x, y, color=color, alpha=0.2 * alpha, linewidth=0.8, linestyle=style)
                    ax.plot(x, ema(y, smooth), color=color, linestyle=style, linewidth=width, alpha=alpha, label=name)
                else:
                    ax.plot(
                        x,
                        y,
                        color=color,
                        linestyle=style,
                        marker="o" if len(x) <= 30 else None,
                        markersize=3,
                        linewidth=width,
                        alpha=alpha,
                        label=name,
                    )
        ax.set_title(title, fontsize=12, fontweight="bold")
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ylim:
            ax.set_ylim(*ylim)
        if drawn:
            if len(keys) > 1 or title == "Held-out eval":
                ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    time_panel(axes.flat[-1], runs)
    handles = [
        matplotlib.lines.Line2D(
            [], [], color=colors[i % len(colors)], linestyle="--" if sync else "-", linewidth=2.5, label=label
        )
        for i, (label, _, sync) in enumerate(runs)
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=min(len(runs), 6),
        fontsize=12,
        frameon=False,
        bbox_to_anchor=(0.5, 0.985),
    )
    note = f"faint: per step; bold: moving average (smoothing {smooth})" if smooth else "per step"
    fig.suptitle(f"april_jax training dashboard ({note})", fontsize=14, y=0.998, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.955))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def time_panel(ax, runs) -> None:
    """Mean seconds per step, stacked by phase, one bar per run."""
    import numpy as np

    labels = [label for label, _, _ in runs]
    left = np.zeros(len(runs))
    for key, name in TIME_PARTS:
        means = np.array([np.mean(series(rows, key)[1] or [0.0]) for _, rows, _ in runs])
        if means.any():
            ax.barh(labels, means, left=left, label=name)
            left += means
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} s", va="center", fontsize=9)
    ax.set_title("Time per step", fontsize=12, fontweight="bold")
    ax.set_xlabel("seconds (mean over steps)")
    ax.set_xlim(0, max(left.max(), 1e-3) * 1.25)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog=prog("april_jax.cli.plot"), description=__doc__.split("\n\n")[1])
    parser.add_argument("runs", nargs="+", help="workdirs (each with a metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default RUN/plots/dashboard.png)")
    parser.add_argument("--smooth", type=float, default=0.6, help="EMA weight in [0, 1), 0: off")
    parser.add_argument("--labels", help="comma-separated run names (default: the workdir names)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= args.smooth < 1:
        parser.error(f"--smooth={args.smooth}: expected a number in [0, 1)")
    labels = args.labels.split(",") if args.labels else [Path(r).resolve().name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    runs = []
    for run, label in zip(args.runs, labels):
        torn = []
        try:
            rows = read_metrics(run, torn)
        except MetricsError as e:
            _fail(str(e))
        if torn:  # a run killed mid-write: its complete lines are still worth a plot
            print(
                f"warning: {Path(run) / 'metrics.jsonl'}:{torn[0]}: incomplete last line (the run was stopped "
                f"while writing it); plotting the {len(rows)} complete steps",
                file=sys.stderr,
            )
        if not rows:
            _fail(f"{Path(run) / 'metrics.jsonl'}: no metrics")
        sync = is_sync(Path(run))
        runs.append((f"{label} (sync)" if sync and "sync" not in label else label, rows, sync))
    out = output_path(args.out, Path(args.runs[0]))
    try:
        draw(runs, out, args.smooth)
    except OSError as e:
        _fail(f"{out}: {e.strerror or e}")
    print(f"wrote {out}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def output_path(given: str | None, first_run: Path) -> Path:
    """Where the PNG goes: --out as given when it names a .png file; a folder (existing, or written
    with a trailing /) gets dashboard.png inside; another suffix, or none, is an error, since
    matplotlib would pick the format from it or append its own and the printed name would lie."""
    if not given:
        return first_run / "plots" / "dashboard.png"
    out = Path(given)
    if out.is_dir() or given.endswith(("/", "\\")):
        return out / "dashboard.png"
    if out.suffix.lower() != ".png":
        _fail(f"--out {given}: expected a .png file or a folder")
    return out


if __name__ == "__main__":
    main()
