"""python -m april_jax.plot WORKDIR: PNGs of reward, response length, busy slots (occupancy) and
off-policy fraction over steps, from WORKDIR/metrics.jsonl, into WORKDIR/plots/."""

from __future__ import annotations

import sys
from pathlib import Path

from april_jax.metrics import read_metrics

PANELS = {
    "reward": ["reward/mean", "eval/avg@2", "eval/avg@4"],
    "response_len": ["rollout/response_len/mean", "rollout/response_len/max"],
    "occupancy": ["rollout/occupancy"],
    "off_policy": ["rollout/off_policy_token_frac", "rollout/staleness_mean"],
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m april_jax.plot WORKDIR", file=sys.stderr)
        raise SystemExit(2)
    workdir = Path(argv[0])
    rows = read_metrics(workdir)
    if not rows:
        print(f"error: {workdir}/metrics.jsonl: no metrics", file=sys.stderr)
        raise SystemExit(2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = workdir / "plots"
    out.mkdir(exist_ok=True)
    for name, keys in PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 3))
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=key)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
    print(f"wrote {len(PANELS)} plots to {out}")


if __name__ == "__main__":
    main()
