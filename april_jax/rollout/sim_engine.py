"""Simulated rollout engine (one replica): the engine interface over a cost model, a KV memory budget
and a response-length distribution.

For scheduling experiments and APRIL's benchmark at the scale of the seed (32 x 8 responses up to
32k tokens), which no CPU can generate for real. Timing comes from `cost_model` (a GPU roofline
or the CPU-calibrated linear model); the engine advances event to event, so it is cheap to run.

What the engine does, vLLM-like:
- continuous batching: a queued request is admitted at a step boundary when a slot is free and its
  context (+1 token) fits the KV budget beside the running and parked contexts (FIFO: the head of
  the queue blocks the rest, as vLLM's scheduler does);
- memory grows one token per running request per step; when the next step would not fit, parked
  KV is dropped first (least recently parked), then the most recently admitted request is
  preempted by recompute (its KV freed, its tokens kept; readmitted first, re-prefilling prompt +
  tokens);
- a group's prompt is prefilled once while any of its members is resident (prefix caching);
- with `reuse_aborted_kv` (default: as a prefix cache keeps freed blocks), an aborted request's KV
  stays in memory (parked, counted against the budget, dropped first under pressure) and a resume of
  exactly those tokens skips its prefill; otherwise it re-prefills;
- abort and weight sync cost what the cost model says.

Deployment, i.e. what happens to the engine during the train step (`update_weights`):
- "colocated" (default): rollout and training share the GPUs; the engine sleeps through the train
  step (vLLM sleep mode level 1: weights to host memory and back, KV discarded), so parked KV and the
  group prompt prefixes are gone and a resumed request re-prefills; sleep and wake cost
  `cost.sleep_wake_s()`;
- "colocated" with `sleeps=False`: rollout and training share the GPUs, but the server's memory
  stays resident beside the trainer's (the deployment plan's 'static' layout, sleep level 0): no
  sleep or wake is paid and the KV survives the train step as disaggregated; the train step still
  runs on these GPUs, between rollouts (the caller charges it);
- "disaggregated": the engine has GPUs of its own and keeps its KV across the train step; the
  GPUs it costs are counted by the caller (benchmarks/rollout.py).

Lengths: each response's total length is drawn once from its group and index (`sample_key`
without the attempt: a resumed response ends where it would have without the interruption, and
a restarted one is regenerated to the same length, not a fresh, usually shorter, draw), from the
seed's distribution: 50% in [1, 1024), 30% in [1024, 8192), 20% in [8192, 32768], times
`length_scale`. Deterministic under `seed`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import zlib
from collections.abc import Iterable

import numpy as np

from april_jax.rollout.cost_model import LinearCPU
from april_jax.rollout.engine import EngineStats, PollingEngine
from april_jax.rollout.types import Request, Result

SEED_DISTRIBUTION = ((0.5, 1, 1024), (0.3, 1024, 8192), (0.2, 8192, 32768))


def draw_length(seed: int, key: str, scale: float = 1.0, distribution=SEED_DISTRIBUTION) -> int:
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    probs = np.array([p for p, _, _ in distribution])
    lo, hi = distribution[rng.choice(len(distribution), p=probs / probs.sum())][1:]
    return max(1, int(round(rng.uniform(lo, hi) * scale)))


def group_of(key: str) -> str:
    return key.split("/", 1)[0]


def length_key(key: str) -> str:
    """The part of a sample key ("group/index/attempt") its length is drawn from: group and index."""
    parts = key.split("/")
    return "/".join(parts[:2]) if len(parts) >= 3 else key


DEPLOYMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass
class _Seq:
    request: Request
    key: str
    remaining_total: int  # tokens until this response would stop on its own, from this request's start
    generated: int = 0
    version_marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (from index, version)

    @property
    def ctx(self) -> int:
        return len(self.request.prompt_ids) + self.generated

    @property
    def left(self) -> int:
        return min(self.remaining_total, self.request.max_new_tokens) - self.generated

    def result(self, reason: str, stop_token: int | None) -> Result:
        n = self.generated
        base = zlib.crc32(self.key.encode()) + len(self.request.prompt_ids)
        tokens = (1 + (base + np.arange(n)) % 1000).tolist()
        if reason == "stop" and stop_token is not None and n:
            tokens[-1] = stop_token
        versions = np.empty(n, np.int64)
        for j, (start, v) in enumerate(self.version_marks):
            end = self.version_marks[j + 1][0] if j + 1 < len(self.version_marks) else n
            versions[start:end] = v
        return Result(self.request.request_id, tokens, [-1.0] * n, versions.tolist(), reason)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimEngineStats(EngineStats):
    """`EngineStats` plus the simulation's own counters; every _s figure is simulated seconds.
    A decode step is one token for every running request."""

    clock_s: float  # the simulated clock (replicas: the set's wall clock)
    prefill_time_s: float  # of it, prefilling (replicas: summed over them)
    abort_time_s: float  # aborting
    sync_time_s: float  # weight syncs
    preempted: int  # requests preempted by recompute when the KV budget ran out
    kv_reused: int  # resumes that took their parked KV instead of a re-prefill
    parked_dropped: int  # parked KV dropped for memory
    kv_tokens_peak: int  # most KV tokens resident at once (replicas: the largest replica's)
    kv_bytes_peak: float  # the same in bytes, from the cost model
    parked_tokens: int  # KV tokens parked now
    sleep_time_s: float = 0.0  # colocated: sleeping and waking around train steps
    kv_lost_in_sleep: int = 0  # colocated: parked KV entries discarded by the sleep
    replicas: int = 1


class SimEngine(PollingEngine):
    def __init__(
        self,
        *,
        slots: int = 256,
        t0: float | None = None,
        c: float = 0.0,
        prefill_s_per_token: float = 0.00073,
        length_scale: float = 1.0,
        seed: int = 0,
        max_model_len: int = 1 << 20,
        policy_version: int = 0,
        reuse_aborted_kv: bool = True,
        cost=None,
        deployment: str = "colocated",
        sleeps: bool = True,
    ):
        if deployment not in DEPLOYMENTS:
            raise ValueError(f"--deployment {deployment!r}: unknown; choose from {', '.join(DEPLOYMENTS)}")
        self.deployment = deployment
        self.sleeps = sleeps and deployment == "colocated"  # on GPUs of its own it never sleeps
        self.max_num_seqs = slots
        self.cost = (
            cost
            if cost is not None
            else LinearCPU(0.010 + 0.00094 * slots if t0 is None else t0, c, prefill_s_per_token)
        )
        self.budget = self.kv_budget_tokens = self.cost.kv_budget_tokens  # KV tokens (inf for the CPU model)
        self.length_scale, self.seed, self.max_model_len = length_scale, seed, max_model_len
        self.policy_version = policy_version
        self.reuse_aborted_kv = reuse_aborted_kv
        self.running: list[_Seq] = []  # admission order
        self.queue: collections.deque[_Seq] = collections.deque()
        self.parked: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> KV tokens kept
        self.running_ctx = 0
        self._ready: list[Result] = []
        self._progress: dict[str, int] = {}  # sample_key -> tokens generated over all segments
        self._clock = 0.0
        self._stats = collections.Counter()
        self.timeline = self._new_timeline()  # (clock, running requests) per decode span
        self._plan: tuple[int, float] | None = None  # next_event's answer until the batch or clock changes

    # ---- the engine interface ----
    def submit(self, requests: Iterable[Request]) -> None:
        for r in requests:
            if (bad := self._rejected(r)) is not None:
                self._ready.append(bad)
                continue
            key = r.sample_key or r.request_id
            total = draw_length(self.seed, length_key(key), self.length_scale)
            seq = _Seq(r, key, max(1, total - self._progress.get(key, 0)), version_marks=[(0, self.policy_version)])
            self.queue.append(seq)

    def step(self) -> list[Result]:
        self.admit()
        event = self.next_event()
        if event is not None:
            self.run_steps(event[0])
        return self.take_ready()

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        self._plan = None
        ids = set(request_ids)
        out = [s.result("abort", None) for s in self.queue if s.request.request_id in ids]
        self.queue = collections.deque(s for s in self.queue if s.request.request_id not in ids)
        keep = []
        for s in self.running:
            if s.request.request_id not in ids:
                keep.append(s)
                continue
            out.append(s.result("abort", None))
            self.running_ctx -= s.ctx
            if self.reuse_aborted_kv:
                self.parked[s.key] = s.ctx
                self.parked.move_to_end(s.key)
        self.running = keep
        self._stats["aborted"] += len(out)
        dt = self.cost.abort_s(len(out))
        self._clock += dt
        self._stats["abort_time_s"] += dt
        return out

    def abort_all(self) -> list[Result]:
        return self.abort([s.request.request_id for s in [*self.queue, *self.running]])

    def update_weights(self, params, version: int) -> None:
        """The train step and the sync after it. `params` is not used (the simulation has no model):
        a sync costs what the cost model says, and later tokens carry `version`. Colocated and
        sleeping, the engine slept through the train step: its KV is gone (running requests, none
        under APRIL, which aborts first, are preempted by recompute)."""
        self._plan = None
        if self.sleeps:
            self._stats["kv_lost_in_sleep"] += len(self.parked)
            self.parked.clear()
            while self.running:
                self._preempt_newest()
            sleep = self.cost.sleep_wake_s()
            self._clock += sleep
            self._stats["sleep_time_s"] += sleep
        self.policy_version = int(version)
        for s in [*self.running, *self.queue]:
            s.version_marks.append((s.generated, self.policy_version))
        dt = self.cost.weight_sync_s()
        self._clock += dt
        self._stats["sync_time_s"] += dt

    def has_unfinished(self) -> bool:
        return bool(self.queue or self._ready or self.running)

    def stats(self) -> SimEngineStats:
        s = self._stats
        return SimEngineStats(
            slots=self.max_num_seqs,
            busy_slots=len(self.running),
            queued=len(self.queue),
            tokens_generated=s["tokens_generated"],
            prefill_tokens=s["prefill_tokens"],
            decode_steps=s["decode_steps"],
            busy_slot_steps=s["busy_slot_steps"],
            aborted=s["aborted"],
            errors=s["errors"],
            policy_version=self.policy_version,
            clock_s=self._clock,
            prefill_time_s=s["prefill_time_s"],
            abort_time_s=s["abort_time_s"],
            sync_time_s=s["sync_time_s"],
            preempted=s["preempted"],
            kv_reused=s["kv_reused"],
            parked_dropped=s["parked_dropped"],
            kv_tokens_peak=s["kv_tokens_peak"],
            kv_bytes_peak=s["kv_tokens_peak"] * self.cost.kv_bytes_per_token,
            parked_tokens=sum(self.parked.values()),
            sleep_time_s=s["sleep_time_s"],
            kv_lost_in_sleep=s["kv_lost_in_sleep"],
        )

    def limit_tokens_per_s(self) -> float:
        """Throughput with every slot busy decoding (no prefill), for the CPU model; the roofline
        limit depends on the contexts of the delivered tokens (see benchmarks/rollout.py)."""
        return self.max_num_seqs / self.cost.decode_step_s(self.max_num_seqs, 0)

    def now(self) -> float:
        return self._clock

    def shutdown(self) -> None:
        self.abort_all()

    # ---- the scheduler, in pieces a replica set can drive ----
    @property
    def idle(self) -> bool:
        return not (self.queue or self.running)

    @property
    def kv_tokens(self) -> int:
        return self.running_ctx + sum(self.parked.values())

    def take_ready(self) -> list[Result]:
        out, self._ready = self._ready, []
        return out

    def set_clock_at_least(self, t: float) -> None:
        if t > self._clock:
            self._clock, self._plan = t, None

    def admit(self) -> None:
        """Admit queued requests while a slot is free and their KV fits (FIFO)."""
        if not self.queue or len(self.running) >= self.max_num_seqs:
            return
        prefill_s = 0.0
        resident_groups = {group_of(s.key) for s in self.running} | {group_of(k) for k in self.parked}
        while self.queue and len(self.running) < self.max_num_seqs:
            s = self.queue[0]
            own = self.parked.get(s.key) if self.parked.get(s.key) == s.ctx else None
            need = s.ctx + 1 - (own or 0)
            while self.kv_tokens + need > self.budget and self._drop_parked(keep=s.key):
                pass
            if self.kv_tokens + need > self.budget:
                if not self.running:  # can never fit: an error, not a hang
                    self.queue.popleft()
                    self._stats["errors"] += 1
                    self._ready.append(
                        Result(
                            s.request.request_id,
                            [],
                            [],
                            [],
                            "error",
                            f"request {s.request.request_id!r}: context {s.ctx} exceeds the KV budget {self.budget}",
                        )
                    )
                    continue
                break
            self.queue.popleft()
            if own is not None:
                del self.parked[s.key]
                self._stats["kv_reused"] += 1
                cached = s.ctx
            else:
                group = group_of(s.key)
                prompt_len = len(s.request.prompt_ids) - self._progress.get(s.key, 0) + s.generated
                cached = prompt_len if group in resident_groups else 0
                resident_groups.add(group)
            new = s.ctx - cached
            prefill_s += self.cost.prefill_s(new, cached)
            self._stats["prefill_tokens"] += new
            self.running.append(s)
            self.running_ctx += s.ctx
            self._plan = None
        self._clock += prefill_s
        self._stats["prefill_time_s"] += prefill_s
        self._note_peak()

    def next_event(self) -> tuple[int, float] | None:
        """(decode steps until the next finish or memory overflow, the clock then); frees memory first."""
        if self._plan is not None:
            return self._plan
        while self.running:
            b = len(self.running)
            fit = (self.budget - self.kv_tokens) // b if math.isfinite(self.budget) else math.inf
            if fit >= 1:
                steps = int(min(min(s.left for s in self.running), fit))
                self._plan = steps, self._clock + self.cost.decode_span_s(b, self.running_ctx, steps)
                return self._plan
            if not self._drop_parked():
                self._preempt_newest()
        return None

    def steps_within(self, horizon: float, max_steps: int) -> int:
        """How many whole decode steps of the current batch end by `horizon` (at most max_steps)."""
        b, lo, hi = len(self.running), 0, max_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._clock + self.cost.decode_span_s(b, self.running_ctx, mid) <= horizon:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def run_steps(self, steps: int) -> None:
        if steps <= 0 or not self.running:
            return
        self._plan = None
        b = len(self.running)
        self._clock += self.cost.decode_span_s(b, self.running_ctx, steps)
        self._stats["decode_steps"] += steps
        self._stats["busy_slot_steps"] += steps * b
        self._stats["tokens_generated"] += steps * b
        self.running_ctx += steps * b
        self._note_peak()
        self.timeline.append((self._clock, b))
        keep = []
        for s in self.running:
            s.generated += steps
            self._progress[s.key] = self._progress.get(s.key, 0) + steps
            reason = (
                "stop"
                if s.generated >= s.remaining_total
                else "length"
                if s.generated >= s.request.max_new_tokens
                else None
            )
            if reason:
                self._ready.append(s.result(reason, s.request.stop_token_ids[0] if s.request.stop_token_ids else None))
                self.running_ctx -= s.ctx
            else:
                keep.append(s)
        self.running = keep

    def advance_to(self, horizon: float) -> None:
        """Run whole decode steps (admitting as slots free) until the next one would end after `horizon`."""
        while self.running or self.queue:
            self.admit()
            event = self.next_event()
            if event is None:
                return
            steps, t = event
            if t > horizon:
                self.run_steps(self.steps_within(horizon, steps))
                return
            self.run_steps(steps)

    # ---- memory pressure ----
    def _drop_parked(self, keep: str | None = None) -> bool:
        self._plan = None
        for key in self.parked:
            if key != keep:
                del self.parked[key]
                self._stats["parked_dropped"] += 1
                return True
        return False

    def _preempt_newest(self) -> None:
        self._plan = None
        s = self.running.pop()
        self.running_ctx -= s.ctx
        self._stats["preempted"] += 1
        # Recompute mode: tokens kept, KV freed; readmitted first, re-prefilling prompt + tokens.
        self.queue.appendleft(s)

    def _note_peak(self) -> None:
        self._stats["kv_tokens_peak"] = max(self._stats["kv_tokens_peak"], self.kv_tokens)
