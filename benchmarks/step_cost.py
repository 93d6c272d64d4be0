"""What one engine step costs against the requests running in it, measured on a real engine, and
the most tokens/s those costs allow any schedule.

`StepCostMeter` wraps an engine (it passes every call through) and times windows of its `step()`
calls against the engine's own counters (`stats()`: decode steps, and busy slots summed over them):
- JAX engine (`window_s=0`): one window per `step()` call, the decode call alone: a call that also
  prefilled (its prefill counter moved) is left out, so the figure is a decode step's cost;
- vLLM (`window_s=1`): the server steps on its own between our polls, so a window is >= 1 s of
  its iterations (the server's Prometheus counters); vLLM schedules prefill chunks into the same
  iterations, so they are in the cost. A window closes at `abort_all` (the step's end): the
  weight sync between two steps, when nothing runs, is never inside one.

Each window is filed under its mean running requests per step (busy slot-steps / decode steps,
rounded): ms per step at b = the bin's seconds / its steps.

The bound (`ceiling`): a step at b running requests makes b tokens in c(b) seconds, so no schedule
on this engine makes more than max_b b / c(b) tokens/s: every step at the best b, no prefill and no
bookkeeping time. A schedule that keeps every slot busy (what APRIL aims at) reaches at most the
rate at b = slots; synchronous rollout spends part of each step in its tail at small b. Bins with
fewer than `min_steps` steps are too noisy to bound anything and are left out.
"""

from __future__ import annotations

import collections

MIN_STEPS = 16


class StepCostMeter:
    def __init__(self, engine, window_s: float = 0.0, decode_only: bool = True):
        self.engine, self.window_s, self.decode_only = engine, window_s, decode_only
        # running requests per step (rounded) -> [seconds, decode steps, busy slot-steps]
        self.bins: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
        self._mark = None  # (engine seconds, stats) where the open window started
        # seconds of the windows filed in `bins`, and of those left out for a prefill (JAX)
        self.seconds = {"binned": 0.0, "with_prefill": 0.0}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _close(self, now: float, stats) -> None:
        t0, s0 = self._mark
        steps = stats.decode_steps - s0.decode_steps
        busy = stats.busy_slot_steps - s0.busy_slot_steps
        prefilled = stats.prefill_tokens != s0.prefill_tokens
        if self.decode_only and prefilled:
            self.seconds["with_prefill"] += now - t0
        elif steps > 0 and busy > 0:
            self.seconds["binned"] += now - t0
            b = self.bins[round(busy / steps)]
            b[0] += now - t0
            b[1] += steps
            b[2] += busy
        self._mark = None

    def step(self):
        engine = self.engine
        if self._mark is None:
            self._mark = (engine.now(), engine.stats())
        out = engine.step()
        now = engine.now()
        if now - self._mark[0] >= self.window_s:
            stats = engine.stats()
            self._close(now, stats)
            if self.window_s:  # the server runs on between polls: the next window starts here
                self._mark = (now, stats)
        return out

    def abort_all(self):
        if self._mark is not None:
            self._close(self.engine.now(), self.engine.stats())
        return self.engine.abort_all()

    def costs(self) -> dict[int, dict]:
        """b -> {"ms": ms per step, "steps": steps measured, "tokens_per_s": b / c(b)}, by b."""
        return {
            b: {"ms": round(1000 * s / n, 2), "steps": int(n), "tokens_per_s": round(busy / s, 1)}
            for b, (s, n, busy) in sorted(self.bins.items())
        }


def ceiling(costs: dict[int, dict], min_steps: int = MIN_STEPS) -> dict:
    """max_b b / c(b) over the bins measured well enough, the b it is at, and the rate at the largest b."""
    ok = {b: c for b, c in costs.items() if c["steps"] >= min_steps}
    if not ok:
        return {"tokens_per_s": None, "at_running": None, "full_running": None, "full_tokens_per_s": None}
    best = max(ok, key=lambda b: ok[b]["tokens_per_s"])
    full = max(ok)
    return {
        "tokens_per_s": ok[best]["tokens_per_s"],
        "at_running": best,
        "full_running": full,
        "full_tokens_per_s": ok[full]["tokens_per_s"],
        "min_steps": min_steps,
    }
