"""How much of the free limit any schedule of uniform (or two-lane) concurrency can reach under a
staleness cap, on a roofline preset: a fixed-point estimate, not a simulation. Prints JSON.

    python -m benchmarks.probes.rollout_cap_estimate [--cost h200-qwen3-4b] [--replicas 8] [--steps-of-time 4 4.5 5]

`benchmarks/rollout.py --engine sim` reports `cap_estimate_fraction_of_free_limit` (this estimate at
max_staleness + 1 steps of time, the most a response started at its step's start has, with the
run's replicas, slots, KV budget and response budget) and APRIL's fraction of it.

Why: a response advances one token per decode step, so a max_response_len response must be
decoded within the time of the steps its cap allows (4 to 5 steps at max_staleness 4, depending
on when in its first step it starts), and the batch of every replica holding one is capped by the
decode step time that allows. Here: choose a step time tau_Y for the first X tokens of every response (the "young" lane)
and tau_O for the rest ("old"), each lane at the batch its tau allows given its token-weighted
mean context, such that X tau_Y + (Lmax - X) tau_O <= k x T, with T the training step's time that
those lanes give; minimise T over a grid. X = Lmax is uniform concurrency. Lengths are the seed's
distribution (32 x 8 per step, 64-token prompts), sampled.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from april_jax.rollout import cost_model


def lane_stats(L, P, X, per_step):
    young, old = np.minimum(L, X), np.maximum(L - X, 0)
    ty, to = young.mean() * per_step, old.mean() * per_step
    cy = (young * P + young * (young - 1) / 2).mean() * per_step
    co = (old * (P + X) + old * (old - 1) / 2).mean() * per_step
    return ty, to, cy / max(ty, 1), co / max(to, 1)


def best_step_time(cost, L, P, X, k, lmax, replicas, slots, per_step, grid=80):
    # tensor parallel: c0 has the all-reduce latency; their per-token bytes are left out
    c0, c1 = cost.step_fixed_s, cost.kv_bytes_per_token / cost.eff_bw
    budget = cost.kv_budget_tokens
    ty, to, cy, co = lane_stats(L, P, X, per_step)
    full = c0 + c1 * budget
    best = (np.inf, None)
    taus = np.linspace(c0 * 1.01, full, grid)
    for tau_y in taus:
        b_y = min((tau_y - c0) / (c1 * cy), slots, budget / cy)
        for tau_o in taus if to else [c0]:
            b_o = min((tau_o - c0) / (c1 * co), slots, budget / co) if to else 1.0
            T = (ty * tau_y / b_y + (to * tau_o / b_o if to else 0.0)) / replicas
            if X * tau_y + (lmax - X) * tau_o <= k * T and T < best[0]:
                best = (T, dict(batch_young=round(b_y, 1), batch_old=round(b_o, 1) if to else None))
    return best


def seed_lengths(max_response_len: int, n: int = 200_000) -> np.ndarray:
    """The seed's length distribution (sim_engine.SEED_DISTRIBUTION), sampled, cut at the budget."""
    rng = np.random.default_rng(0)
    u = rng.random(n)
    L = np.where(
        u < 0.5,
        rng.uniform(1, 1024, u.size),
        np.where(u < 0.8, rng.uniform(1024, 8192, u.size), rng.uniform(8192, 32768, u.size)),
    )
    return np.minimum(L, max_response_len)


def estimate(cost, *, replicas, slots, max_response_len, steps_of_time, prompt_len=64, per_step=256, lanes=None):
    """(free step time, rows): per steps_of_time and young-lane split, the least step time of a
    uniform / two-lane schedule under the cap and its fraction of the free bound."""
    L = seed_lengths(max_response_len)
    ctx = (L * prompt_len + L * (L - 1) / 2).mean() * per_step
    free = cost_model.time_lower_bound_s(
        cost, tokens=int(L.mean() * per_step), ctx_sum=int(ctx), prompt_lens=[], slots=slots, replicas=replicas
    )
    rows = []
    for k in steps_of_time:
        for X in lanes or (max_response_len, 8192, 2048):
            T, how = best_step_time(cost, L, prompt_len, X, k, max_response_len, replicas, slots, per_step)
            rows.append(
                {
                    "steps_of_time": k,
                    "young_lane_tokens": X,
                    "step_time_s": round(T, 1),
                    "fraction_of_free_limit": round(free / T, 3),
                    **(how or {}),
                }
            )
    return free, rows


def cap_fraction(cost, *, replicas, slots, max_response_len, max_staleness, prompt_len=64, per_step=256) -> float:
    """The best fraction of the free bound this estimate finds at max_staleness + 1 steps of time."""
    _, rows = estimate(
        cost,
        replicas=replicas,
        slots=slots,
        max_response_len=max_response_len,
        steps_of_time=[max_staleness + 1],
        prompt_len=prompt_len,
        per_step=per_step,
    )
    return max(r["fraction_of_free_limit"] for r in rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cost", default="h200-qwen3-4b")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--steps-of-time", type=float, nargs="+", default=[4.0, 4.5, 5.0])
    parser.add_argument("--max-response-len", type=int, default=32768)
    args = parser.parse_args()
    cost = cost_model.make(args.cost)
    free, rows = estimate(
        cost,
        replicas=args.replicas,
        slots=256,
        max_response_len=args.max_response_len,
        steps_of_time=args.steps_of_time,
    )
    print(json.dumps({"cost": args.cost, "replicas": args.replicas, "free_step_time_s": round(free, 1), "rows": rows}))


if __name__ == "__main__":
    main()
