"""Sensitivity study of APRIL vs sync on the simulated engine (roofline presets): prints JSON.

    python -m benchmarks.rollout_sweep --cost h200-qwen3-4b --seeds 0 1 2 [--steps 20] [--sections all] [--jobs 2] [--markdown]

Every row runs APRIL with the product defaults (`RolloutConfig()`, colocated) or a variant of them,
against the synchronous baseline on the same preset, replicas, deployment, prompts, length draws and
response budget; each (row, seed) prints one JSON line, then one summary line per row with mean /
min / max over the seeds. `--markdown` prints the summary as the tables of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import types

import numpy as np

from benchmarks import rollout

# None: the product default (benchmarks/rollout.py's flags left out)
BASE = dict(
    engine="sim",
    cost="h200-qwen3-4b",
    replicas=8,
    steps=20,
    warmup_steps=None,
    seed=0,
    slots=256,
    length_scale=1.0,
    max_response_len=32768,
    prompt_len=64,
    prefill_ms_per_token=None,
    step_overhead_ms=None,
    min_prefill_batch=1,
    reuse_aborted_kv=False,
    decode_steps_per_call=8,
    deployment="colocated",
    train_gpus=None,
    train_mfu=None,
    **{k: None for k in rollout.OVERRIDES},
)
DEFAULTS = {}
# The paper's orchestrator: over-sampled groups drain, no refill, nothing sized by the cap.
BEFORE = dict(refill="groups", inflight="over_sampling")

SECTIONS = {
    "headline": [
        ("product defaults (colocated)", DEFAULTS),
        ("without finish_wait and headroom", {"finish_wait": 0.0, "inflight_headroom": 0.0}),
        ("in flight by over-sampling only", {"inflight": "over_sampling"}),
        ("the paper's orchestrator (groups k/n, no cap sizing)", BEFORE),
        ("the paper's, a resumed group counts whole (slime)", {**BEFORE, "resume_count": "group"}),
    ],
    "over_sampling": [(f"over-sampling {os} ({os / 32:g}x)", {"over_sampling_batch_size": os}) for os in (32, 48, 96)],
    "max_staleness": [(f"max_staleness {s}", {"max_staleness": s}) for s in (0, 1, 2, 3, 16)],
    "resume_count": [
        ("groups refill, resumed group counts k/n", {"refill": "groups"}),
        ("groups refill, resumed group counts whole", {"refill": "groups", "resume_count": "group"}),
    ],
    "max_response_len": [(f"max_response_len {n}", {"max_response_len": n}) for n in (8192, 16384)],
    "deployment": [("disaggregated (KV kept across the train step)", {"deployment": "disaggregated"})],
    "replicas": [(f"replicas {r}", {"replicas": r}) for r in (1, 2, 4)],
}
# the sync run depends on these
SHARED = ("replicas", "max_response_len", "cost", "steps", "seed", "step_overhead_ms", "deployment")


def args_for(**kw):
    a = types.SimpleNamespace(**{**BASE, **kw})
    if a.warmup_steps is None:
        a.warmup_steps = max(1, a.steps // 4)
    return a


def _run(task):
    mode, kw = task
    r = rollout.run(mode, args_for(**kw))
    keep = (
        "tokens_per_s",
        "free_limit_tokens_per_s",
        "e2e_steps_per_s",
        "on_policy_token_frac",
        "mean_loss_weight",
        "delivered_len_mean",
        "dropped_tokens",
        "prefill_time_frac",
        "kv_bytes_peak",
        "kv_bytes_budget",
        "preempted",
        "staleness_max",
        "buffered_tokens_end",
    )
    return task, {k: r[k] for k in keep}


def row_result(sync: dict, april: dict) -> dict:
    return {
        "speedup": april["tokens_per_s"] / sync["tokens_per_s"],
        "e2e_speedup": april["e2e_steps_per_s"] / sync["e2e_steps_per_s"],
        "april_fraction_of_free_limit": april["tokens_per_s"] / april["free_limit_tokens_per_s"],
        "sync_fraction_of_free_limit": sync["tokens_per_s"] / sync["free_limit_tokens_per_s"],
        "april_tokens_per_s": april["tokens_per_s"],
        "sync_tokens_per_s": sync["tokens_per_s"],
        "april_on_policy_token_frac": april["on_policy_token_frac"],
        "april_mean_loss_weight": april["mean_loss_weight"],
        "april_delivered_len_mean": april["delivered_len_mean"],
        "sync_delivered_len_mean": sync["delivered_len_mean"],
        "april_dropped_tokens": april["dropped_tokens"],
        "april_prefill_time_frac": april["prefill_time_frac"],
        "april_preempted": april["preempted"],
        "april_kv_peak_frac": april["kv_bytes_peak"] / april["kv_bytes_budget"],
        "sync_kv_peak_frac": sync["kv_bytes_peak"] / sync["kv_bytes_budget"],
        "april_staleness_max": april["staleness_max"],
        "april_buffered_tokens_end": april["buffered_tokens_end"],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cost", default="h200-qwen3-4b")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sections", nargs="+", default=["all"], help=f"any of: {', '.join(SECTIONS)}")
    parser.add_argument("--step-overhead-ms", type=float, default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--reuse-log",
        nargs="*",
        default=[],
        help="per-task JSON lines of earlier sweeps: tasks found there are not run again",
    )
    parser.add_argument(
        "--from-log",
        default=None,
        help="summarise the per-task JSON lines a sweep wrote to stderr "
        "(the rows whose runs are all there) instead of running",
    )
    args = parser.parse_args()
    names = list(SECTIONS) if args.sections == ["all"] else args.sections
    for name in names:
        if name not in SECTIONS:
            parser.error(f"--sections {name!r}: unknown; choose from {', '.join(SECTIONS)}")
    common = dict(cost=args.cost, steps=args.steps, step_overhead_ms=args.step_overhead_ms)
    rows = [(name, label, {**over, **common}) for name in names for label, over in SECTIONS[name]]
    tasks, seen = [], set()
    for seed in args.seeds:  # seed by seed, so an interrupted sweep still has whole rows for the first seeds
        for _, _, over in rows:
            kw = {**over, "seed": seed}
            sync_kw = {k: kw[k] for k in SHARED if k in kw}
            for task in (("sync", sync_kw), ("april", kw)):
                key = json.dumps(task, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    tasks.append(task)
    if args.from_log:
        results = {}
        with open(args.from_log) as f:
            for line in f:
                if line.startswith('{"task"'):
                    d = json.loads(line)
                    results[json.dumps(tuple(d["task"]), sort_keys=True)] = d["result"]
        summarise(rows, results, args)
        return
    results = {}
    for path in args.reuse_log:
        with open(path) as f:
            for line in f:
                if line.startswith('{"task"'):
                    d = json.loads(line)
                    results[json.dumps(tuple(d["task"]), sort_keys=True)] = d["result"]
    tasks = [t for t in tasks if json.dumps(t, sort_keys=True) not in results]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for t, r in pool.imap(_run, tasks):
            results[json.dumps(t, sort_keys=True)] = r
            print(json.dumps({"task": t, "result": r}), file=sys.stderr, flush=True)
    summarise(rows, results, args)


def summarise(rows, results, args):
    summary = []
    for name, label, over in rows:
        per_seed = []
        for seed in args.seeds:
            kw = {**over, "seed": seed}
            sync = results.get(json.dumps(("sync", {k: kw[k] for k in SHARED if k in kw}), sort_keys=True))
            april = results.get(json.dumps(("april", kw), sort_keys=True))
            if sync is None or april is None:
                continue
            r = row_result(sync, april)
            per_seed.append(r)
            print(json.dumps({"section": name, "row": label, "seed": seed, "config": over, **r}), flush=True)
        if not per_seed:
            continue
        stats = {
            k: {
                "mean": float(np.mean([r[k] for r in per_seed])),
                "min": float(np.min([r[k] for r in per_seed])),
                "max": float(np.max([r[k] for r in per_seed])),
            }
            for k in per_seed[0]
        }
        seeds = [
            seed for seed in args.seeds if json.dumps(("april", {**over, "seed": seed}), sort_keys=True) in results
        ]
        summary.append({"section": name, "row": label, "seeds": seeds, "config": over, **stats})
    for s in summary:
        print(json.dumps({"summary": True, **s}))
    if args.markdown:
        print(markdown(summary, args))


def markdown(summary, args) -> str:
    def spread(s, k, fmt="{:.2f}"):
        return f"{fmt.format(s[k]['mean'])} ({fmt.format(s[k]['min'])}-{fmt.format(s[k]['max'])})"

    lines = [
        f"{args.cost}, {args.steps} steps: mean (min-max) over the seeds listed",
        "",
        "| section | row | seeds | e2e speedup | rollout speedup | APRIL / free limit | sync / free limit | on-policy frac | "
        "mean loss weight | delivered len APRIL / sync | dropped tokens | prefill time | preempted | KV peak / budget APRIL, sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['section']} | {s['row']} | {' '.join(map(str, s['seeds']))} | {spread(s, 'e2e_speedup')} | "
            f"{spread(s, 'speedup')} | {spread(s, 'april_fraction_of_free_limit')} | "
            f"{spread(s, 'sync_fraction_of_free_limit')} | "
            f"{spread(s, 'april_on_policy_token_frac')} | "
            f"{spread(s, 'april_mean_loss_weight')} | {s['april_delivered_len_mean']['mean']:.0f} / "
            f"{s['sync_delivered_len_mean']['mean']:.0f} | {s['april_dropped_tokens']['mean'] / 1e6:.2f}M | "
            f"{s['april_prefill_time_frac']['mean']:.3f} | {s['april_preempted']['mean']:.0f} | "
            f"{s['april_kv_peak_frac']['max']:.2f}, {s['sync_kv_peak_frac']['max']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
