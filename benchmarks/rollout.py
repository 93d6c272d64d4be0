"""APRIL vs the synchronous baseline on the same engine and the same prompts.

    python benchmarks/rollout.py --engine sim [--cost h200-qwen3-4b] [--replicas 8] [--steps 8] [--seed 0] [--png busy.png]
    python benchmarks/rollout.py --engine sim --cost cpu-jax       # the earlier CPU-calibrated model, one engine
    python benchmarks/rollout.py --engine jax [--steps 8] [--length-scale 0.03125] [--reuse-aborted-kv]

Both modes: 32 groups x 8 samples per step, the seed's long-tailed length distribution (scaled
for the JAX engine so it fits on CPU). Sync: over_sampling_batch_size = rollout_batch_size = 32,
partial_rollout off. APRIL: over-sampling 64, partial rollout on. The policy version goes up by one
after every step, as in training. Throughput counts only response tokens of groups delivered to
training, over the steps after the first, divided by the engine time of those steps (weight syncs
included). On the simulated engine (`--cost`: a GPU roofline preset, `april_jax/rollout/cost_model.py`)
every replica has its own KV budget and groups are routed whole; `limit_tokens_per_s` is the
counted tokens over the least time any schedule needs for them under the same cost model, memory
and staleness cap (each response's tokens within the steps its cap allows: `max_staleness` for
APRIL, 0 for sync; `cost_model.time_lower_bound_s` with windows), per run;
`free_limit_tokens_per_s` drops the staleness windows. On a roofline preset APRIL runs the design of
issue 13 by default (refill as members finish, aborted KV parked within the budget, requests in
flight sized by the cap and the KV budget, max_staleness 4: at most 5 policy versions per response);
`--refill groups --re-prefill --inflight over_sampling` is the orchestrator before it. On the JAX engine the model is a tiny random
Qwen3 whose responses stop at lengths drawn from the same distribution (via a per-sample length
budget), so the length tail is the seed's and not an accident of random weights.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from april_jax.data.types import PromptRecord
from april_jax.rollout.april import April, RolloutConfig
from april_jax.rollout import cost_model
from april_jax.rollout.sim_engine import draw_length
from april_jax.rollout.sim_replicas import SimReplicas


def prompts(seed: int, length: int, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        yield PromptRecord(uid=f"p{i}", prompt_ids=rng.integers(1, vocab, length).tolist())


class LengthBudgetEngine:
    """Wraps the JAX engine: each request's max_new_tokens is cut to its drawn remaining length, so a
    random-weight model produces the seed's long tail; finishing there is reported as a stop."""

    def __init__(self, engine, seed: int, scale: float, params):
        self.engine, self.seed, self.scale = engine, seed, scale
        self.params = params  # what each weight sync pushes: the model's own weights, unchanged
        self.progress: dict[str, int] = {}
        self.budget: dict[str, tuple[str, int]] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests):
        import dataclasses

        out = []
        for r in requests:
            total = draw_length(self.seed, r.sample_key, self.scale)
            left = max(1, total - self.progress.get(r.sample_key, 0))
            natural = left <= r.max_new_tokens
            self.budget[r.request_id] = (r.sample_key, natural)
            out.append(dataclasses.replace(r, max_new_tokens=min(left, r.max_new_tokens)))
        self.engine.submit(out)

    def _fix(self, results):
        for res in results:
            key, natural = self.budget.pop(res.request_id)
            self.progress[key] = self.progress.get(key, 0) + len(res.token_ids)
            if res.finish_reason == "length" and natural:
                res.finish_reason = "stop"
        return results

    def step(self):
        return self._fix(self.engine.step())

    def abort_all(self):
        return self._fix(self.engine.abort_all())


def make_engine(kind: str, seed: int, slots: int, length_scale: float, max_response_len: int, prompt_len: int,
                prefill_ms=None, min_prefill_batch: int = 1, reuse_aborted_kv: bool = False, steps_per_call: int = 8,
                cost: str = "cpu-jax", replicas: int = 1, step_overhead_ms=None):
    if kind == "sim":
        overrides = {}
        if cost == "cpu-jax" and prefill_ms is not None:
            overrides["p"] = prefill_ms / 1000
        if cost != "cpu-jax" and step_overhead_ms is not None:
            overrides["step_overhead_s"] = step_overhead_ms / 1000
        model = cost_model.make(cost, slots, **overrides)
        return SimReplicas(replicas, slots=slots, cost=model, seed=seed, length_scale=length_scale,
                           reuse_aborted_kv=reuse_aborted_kv)
    from april_jax.models import qwen3

    cfg = qwen3.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    from april_jax.rollout.jax_engine import JaxEngine

    model = qwen3.init_model(cfg, seed=seed)
    engine = JaxEngine(model, max_num_seqs=slots, max_model_len=prompt_len + max_response_len + 1,
                       seed=seed, min_prefill_batch=min_prefill_batch, reuse_aborted_kv=reuse_aborted_kv,
                       samples_per_prompt=8, decode_steps_per_call=steps_per_call)
    engine.warmup(modes=("sample",))
    from flax import nnx

    return LengthBudgetEngine(engine, seed, length_scale, nnx.state(model))


def rollout_config(mode: str, args) -> RolloutConfig:
    sync = mode == "sync"
    return RolloutConfig(rollout_batch_size=32, n_samples_per_prompt=8,
                         over_sampling_batch_size=32 if sync else args.over_sampling, partial_rollout=not sync,
                         max_response_len=args.max_response_len, max_staleness=args.max_staleness, temperature=1.0,
                         refill="groups" if sync else args.refill, resume_count=args.resume_count,
                         stale_policy=args.stale_policy, inflight="over_sampling" if sync else args.inflight,
                         **{k: getattr(args, k) for k in ("finish_wait", "inflight_headroom")
                            if getattr(args, k, None) is not None})


def run(mode: str, args) -> dict:
    cfg = rollout_config(mode, args)
    engine = make_engine(args.engine, args.seed, args.slots, args.length_scale, args.max_response_len,
                         args.prompt_len, args.prefill_ms_per_token, args.min_prefill_batch,
                         args.reuse_aborted_kv and mode != "sync", args.decode_steps_per_call, args.cost, args.replicas,
                         args.step_overhead_ms)
    april = April(cfg, prompts(args.seed, args.prompt_len))
    w = args.warmup_steps
    delivered_tokens = on_policy = weight = 0.0
    useful = useful_ctx = 0
    prompt_lens, lengths = [], []
    steps, timeline = [], []
    windows = []  # per response with tokens in the window: tokens, sum sqrt(context), context sum, first, last step
    # the staleness a delivered response can have: its tokens come from the steps [d - cap, d]
    cap = cfg.max_staleness if cfg.partial_rollout else 0

    def count_useful(g, step=None):  # tokens generated in the window (versions >= w): their number and context sum
        nonlocal useful, useful_ctx
        for s in g.samples:
            index = np.flatnonzero(np.asarray(s.response_versions, np.int64) >= w)
            if not index.size:
                continue
            ctx = len(s.prompt_ids) + index
            useful += index.size
            useful_ctx += int(ctx.sum())
            first, last = (0, args.steps - w - 1) if step is None else (max(step - cap, w) - w, step - w)
            windows.append((index.size, float(np.sqrt(ctx).sum()), float(ctx.sum()), first, last))

    for step in range(args.steps):
        if step == w:
            start, s_start = engine.now(), engine.stats()
        groups, m = april.collect(engine, version=step)
        assert len(groups) == 32 and all(len(g.samples) == 8 for g in groups)
        # the simulated engine has no model: its syncs cost what the cost model says
        engine.update_weights(engine.params if args.engine == "jax" else None, step + 1)
        steps.append(m)
        timeline += engine.timeline  # the engine keeps only its latest points: drain them every step
        engine.timeline.clear()
        if step >= w:
            delivered_tokens += m["rollout/tokens"]
            for g in groups:
                if min(min(s.response_versions) for s in g.samples) >= w:  # prefilled within the window
                    prompt_lens.append(len(g.prompt.prompt_ids))
                count_useful(g, step)
                for s in g.samples:
                    stale = step - np.asarray(s.response_versions)
                    on_policy += float(np.sum(stale == 0))
                    weight += float(np.sum(0.9 ** stale))
                    lengths.append(len(s.response_ids))
    buffered_before = useful
    for g in april.buffer.groups():
        count_useful(g)
    time = engine.now() - start
    s_end = engine.stats()
    window = steps[w:]
    out = {"delivered_tokens_per_s": delivered_tokens / time, "useful_tokens_per_s": useful / time,
           "buffered_token_frac": (useful - buffered_before) / max(useful, 1),
           "off_policy_token_frac": 1 - on_policy / delivered_tokens,
           "dropped_tokens": sum(m["rollout/dropped_tokens"] for m in window),
           # inflight=auto's finish_wait: engine time spent past the target, and groups delivered in a fresher one's place
           "finish_wait_s": sum(m.get("rollout/finish_wait_s", 0.0) for m in window),
           "swapped_groups": sum(m.get("rollout/swapped_groups", 0) for m in window),
           "prefill_tokens_per_response_token": sum(m["rollout/prefill_tokens"] for m in window) / delivered_tokens,
           "occupancy": float(np.mean([m["rollout/occupancy"] for m in window])),
           "on_policy_token_frac": on_policy / delivered_tokens, "mean_loss_weight": weight / delivered_tokens,
           "delivered_len_mean": float(np.mean(lengths)), "staleness_max": max(m["rollout/staleness_max"] for m in steps),
           "timeline": timeline, "steps": steps}
    out["tokens_per_s"] = out["delivered_tokens_per_s"]
    if args.engine == "sim":
        # Tokens generated in the window and delivered, or still in the buffer at its end: the
        # steady-state delivery rate without crediting tokens generated before the window (a
        # 20-step window is short beside APRIL's buffer); equal to the delivered rate for sync.
        out["tokens_per_s"] = out["useful_tokens_per_s"]
        replicas = len(engine.replicas)
        kw = dict(tokens=useful, ctx_sum=useful_ctx, prompt_lens=prompt_lens, slots=args.slots, replicas=replicas,
                  syncs=args.steps - w)
        free = cost_model.time_lower_bound_s(engine.cost, **kw)
        bound = free
        if not isinstance(engine.cost, cost_model.LinearCPU):
            cols = np.asarray(windows, float).T
            bound = cost_model.time_lower_bound_s(engine.cost, **kw, windows=cost_model.StalenessWindows(
                tokens=cols[0], sqrt_ctx=cols[1], ctx=cols[2], first=cols[3].astype(int), last=cols[4].astype(int),
                steps=args.steps - w))
        out.update(limit_tokens_per_s=useful / bound, free_limit_tokens_per_s=useful / free, time_s=time,
                   prefill_time_frac=(s_end.prefill_time_s - s_start.prefill_time_s) / (replicas * time),
                   kv_bytes_peak=s_end.kv_bytes_peak, kv_bytes_budget=engine.cost.kv_budget_bytes,
                   preempted=s_end.preempted - s_start.preempted)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["sim", "jax"], default="sim")
    parser.add_argument("--cost", default="h200-qwen3-4b",
                        help="sim only: a roofline preset (h200-qwen3-4b, h100-qwen3-4b, h200-qwen3-8b) or cpu-jax")
    parser.add_argument("--replicas", type=int, default=None, help="sim only: engine replicas, one per GPU "
                        "(default 8 for a roofline preset, 1 for cpu-jax)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="steps left out of the figures (default: a quarter of --steps, at least 1): APRIL's "
                        "buffer fills over the first few steps; a real run amortises that over hundreds")
    parser.add_argument("--slots", type=int, default=None, help="max running requests per replica (default: 256 sim, 64 jax)")
    parser.add_argument("--length-scale", type=float, default=None, help="default: 1.0 sim, 1/32 jax (responses up to 1024 tokens: the largest scale "
                        "that runs in ~6 minutes on 2 cores; at 1/64 half the responses are under 16 tokens "
                        "and per-request costs weigh more than at any real scale)")
    parser.add_argument("--max-response-len", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="default: 64 x length scale, at least 8 (all lengths scaled alike)")
    parser.add_argument("--over-sampling", type=int, default=64, help="APRIL's over_sampling_batch_size")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="default: 4 on a roofline preset (at most 5 policy versions per response), else 5")
    parser.add_argument("--stale-policy", choices=["restart", "drop_group"], default="restart")
    parser.add_argument("--refill", choices=["groups", "members"], default=None,
                        help="APRIL's in-flight budget (default: members on a roofline preset, else groups)")
    parser.add_argument("--resume-count", choices=["fraction", "group"], default="fraction")
    parser.add_argument("--inflight", choices=["over_sampling", "auto"], default=None,
                        help="APRIL's in-flight limit (default: auto on a roofline preset, else over_sampling)")
    parser.add_argument("--finish-wait", type=float, default=None,
                        help="inflight=auto: rollout.finish_wait (default: the config's, 1.0; 0: off)")
    parser.add_argument("--inflight-headroom", type=float, default=None,
                        help="inflight=auto: rollout.inflight_headroom (default: the config's, 0.75)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=None,
                        help="--cost cpu-jax only; default: the CPU-calibrated 0.73")
    parser.add_argument("--step-overhead-ms", type=float, default=None, help="roofline presets: per decode step (default 1)")
    parser.add_argument("--min-prefill-batch", type=int, default=1, help="jax only: refill when this many slots are free")
    parser.add_argument("--reuse-aborted-kv", action="store_true",
                        help="APRIL's resumed requests take their parked KV instead of a re-prefill (default on a roofline preset)")
    parser.add_argument("--re-prefill", action="store_true", help="roofline presets: resumed requests re-prefill")
    parser.add_argument("--decode-steps-per-call", type=int, default=8, help="jax only")
    parser.add_argument("--png", default=None, help="write busy slots over time for both modes")
    parser.add_argument("--full", action="store_true", help="also print per-step metrics")
    args = parser.parse_args()
    if args.replicas is None:
        args.replicas = 8 if args.engine == "sim" and args.cost != "cpu-jax" else 1
    if args.engine == "sim" and args.cost != "cpu-jax" and args.cost not in cost_model.PRESETS:
        parser.error(f"--cost {args.cost!r}: unknown; choose from cpu-jax, {', '.join(cost_model.PRESETS)}")
    design = args.engine == "sim" and args.cost != "cpu-jax"  # the design of issue 13 on the roofline presets
    if args.max_staleness is None:
        args.max_staleness = 4 if design else 5
    if args.inflight is None:
        args.inflight = "auto" if design else "over_sampling"
    if args.refill is None:
        args.refill = "members" if design else "groups"
    if design and not args.re_prefill:
        args.reuse_aborted_kv = True
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 4)
    if not 0 < args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be in [1, --steps)")
    if args.slots is None:
        args.slots = 256 if args.engine == "sim" else 64
    if args.length_scale is None:
        args.length_scale = 1.0 if args.engine == "sim" else 1 / 32
    if args.prompt_len is None:
        args.prompt_len = max(8, round(64 * args.length_scale))
    if args.max_response_len is None:
        args.max_response_len = int(32768 * args.length_scale)
    print(json.dumps(compare(args)))


def compare(args) -> dict:
    if args.engine == "sim":
        sync, april = run("sync", args), run("april", args)
        limits = [april["limit_tokens_per_s"]]
    else:
        # Measured before and after the two runs and averaged: this machine drifts by 10-20% over
        # minutes, and a limit taken at one end only would tilt the fractions.
        limits = [measure_jax_limit(args)]
        sync, april = run("sync", args), run("april", args)
        limits.append(measure_jax_limit(args))
    limit = float(np.mean(limits))
    out = {
        "benchmark": "rollout", "engine": args.engine, "steps": args.steps, "warmup_steps": args.warmup_steps, "seed": args.seed, "slots": args.slots,
        "length_scale": args.length_scale, "max_response_len": args.max_response_len, "prompt_len": args.prompt_len,
        "prefill_ms_per_token": args.prefill_ms_per_token, "min_prefill_batch": args.min_prefill_batch,
        "reuse_aborted_kv": args.reuse_aborted_kv, "decode_steps_per_call": args.decode_steps_per_call,
        "over_sampling": args.over_sampling, "max_staleness": args.max_staleness, "refill": args.refill,
        "resume_count": args.resume_count, "stale_policy": args.stale_policy, "inflight": args.inflight,
        "sync_tokens_per_s": round(sync["tokens_per_s"], 1), "april_tokens_per_s": round(april["tokens_per_s"], 1),
        "speedup": round(april["tokens_per_s"] / sync["tokens_per_s"], 3),
        "limit_tokens_per_s": round(limit, 1), "limit_before_after": [round(x, 1) for x in limits],
        "april_fraction_of_limit": round(april["tokens_per_s"] / limit, 3),
        "sync_fraction_of_limit": round(sync["tokens_per_s"] / sync.get("limit_tokens_per_s", limit), 3),
        "april_occupancy": round(april["occupancy"], 3), "sync_occupancy": round(sync["occupancy"], 3),
        "off_policy_token_frac": round(april["off_policy_token_frac"], 3),
        "april_prefill_tokens_per_response_token": round(april["prefill_tokens_per_response_token"], 2),
        "sync_prefill_tokens_per_response_token": round(sync["prefill_tokens_per_response_token"], 2),
        "dropped_tokens": april["dropped_tokens"],
        "april_delivered_tokens_per_s": round(april["delivered_tokens_per_s"], 1),
        "april_buffered_token_frac": round(april["buffered_token_frac"], 4),
        "april_staleness_max": april["staleness_max"],
        "april_finish_wait_frac": round(april["finish_wait_s"] / april["time_s"], 4) if april.get("time_s") else 0.0,
        "april_swapped_groups": april["swapped_groups"],
    }
    for name, r in (("april", april), ("sync", sync)):
        for key in ("on_policy_token_frac", "mean_loss_weight", "delivered_len_mean"):
            out[f"{name}_{key}"] = round(r[key], 4)
    if args.engine == "sim":
        out["cost"] = april_cost = make_engine("sim", 0, args.slots, 1.0, 1, 1, args.prefill_ms_per_token,
                                               cost=args.cost, step_overhead_ms=args.step_overhead_ms).cost.describe()
        out["replicas"] = args.replicas
        budget = april_cost.get("kv_budget_bytes")
        out["kv_bytes_budget"] = budget
        out["sync_limit_tokens_per_s"] = round(sync["limit_tokens_per_s"], 1)
        # the limits without the staleness windows (any schedule, any staleness): what the cap costs
        out["free_limit_tokens_per_s"] = round(april["free_limit_tokens_per_s"], 1)
        out["april_fraction_of_free_limit"] = round(april["tokens_per_s"] / april["free_limit_tokens_per_s"], 3)
        out["sync_fraction_of_free_limit"] = round(sync["tokens_per_s"] / sync["free_limit_tokens_per_s"], 3)
        out["april_inflight_limit_last"] = april["steps"][-1].get("rollout/inflight_limit")
        for name, r in (("april", april), ("sync", sync)):
            out[f"{name}_prefill_time_frac"] = round(r["prefill_time_frac"], 4)
            out[f"{name}_kv_bytes_peak"] = r["kv_bytes_peak"]
            out[f"{name}_preempted"] = r["preempted"]
            out[f"{name}_time_s"] = round(r["time_s"], 2)
    if getattr(args, "png", None):
        plot(sync["timeline"], april["timeline"], args)
    if getattr(args, "full", False):
        out["april_steps"], out["sync_steps"] = april["steps"], sync["steps"]
    return out


def measure_jax_limit(args) -> float:
    """Tokens/s of the JAX engine with every slot busy: long greedy requests, no stops."""
    from april_jax.rollout.types import Request, SamplingParams

    engine = make_engine("jax", args.seed, args.slots, 1.0, args.max_response_len, args.prompt_len,
                         steps_per_call=args.decode_steps_per_call).engine
    n = args.max_response_len
    reqs = lambda tag: [Request(f"{tag}{i}", list(range(1, args.prompt_len + 1)), n, SamplingParams(1.0, seed=i)) for i in range(args.slots)]
    engine.generate(reqs("warm"))
    t0, before = engine.now(), engine.stats().tokens_generated
    engine.submit(reqs("run"))
    for _ in range(n // 2):  # decode-only window: all slots busy
        engine.step()
    rate = (engine.stats().tokens_generated - before - args.slots) / (engine.now() - t0)
    engine.abort_all()
    return rate


def plot(sync_tl, april_tl, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for label, tl in (("sync", sync_tl), ("APRIL", april_tl)):
        t, busy = zip(*tl)
        t = np.asarray(t) - t[0]  # from the first decode step: engine clocks also count warm-up
        ax.step(t, busy, where="pre", label=label, lw=0.8)
    ax.set_xlabel("engine time (s)" + (" (simulated)" if args.engine == "sim" else ""))
    ax.set_ylabel("busy slots")
    ax.set_title(f"{args.engine} engine, {args.slots} slots, {args.steps} steps of 32x8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
