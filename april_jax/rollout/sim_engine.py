"""Simulated rollout engine: the engine interface, a cost model and a response-length distribution.

For scheduling experiments and APRIL's benchmark at the scale of the seed (32 x 8 responses up to
32k tokens), which no CPU can generate for real.

Cost model (simulated seconds):
    decode step   t = t0 + c * busy_slots        (every busy slot gains one token)
    prefill       p * prompt_tokens per admitted request (a resumed request re-prefills prompt + partial,
                  or costs nothing with `reuse_aborted_kv`, as the JAX engine's parked KV)
Defaults are calibrated from the embedded JAX engine on the project's CPU machines
(`benchmarks/engine.py`, 40M model: a decode step costs ~11 ms at batch 1 and ~70 ms at batch 64,
i.e. 10 ms + 0.94 ms per slot; batched prefill ~1,365 tokens/s -> p = 0.73 ms/token). That
engine computes every slot each step, busy or idle, so its step time is flat in `busy`:
t0 = 10 ms + 0.94 ms * slots and c = 0. A vLLM-like engine that skips idle slots is modelled by
passing t0 and c explicitly (`t0=0.010, c=0.00094` is the same hardware skipping idle slots).
On GPUs prefill is far cheaper per token than decode; pass a smaller `prefill_s_per_token`.

Lengths: each response's total length is drawn once from `sample_key` (so a resumed response
ends where it would have without the interruption), from the seed's distribution: 50% in
[1, 1024), 30% in [1024, 8192), 20% in [8192, 32768], times `length_scale`. Deterministic under
`seed`. The engine advances event to event (the next request to finish), so it is cheap to run.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from typing import Iterable

import numpy as np

from april_jax.rollout.types import PollingEngine, Request, Result

SEED_DISTRIBUTION = ((0.5, 1, 1024), (0.3, 1024, 8192), (0.2, 8192, 32768))


def draw_length(seed: int, key: str, scale: float = 1.0, distribution=SEED_DISTRIBUTION) -> int:
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    probs = np.array([p for p, _, _ in distribution])
    lo, hi = distribution[rng.choice(len(distribution), p=probs / probs.sum())][1:]
    return max(1, int(round(rng.uniform(lo, hi) * scale)))


@dataclasses.dataclass
class _Running:
    request: Request
    key: str
    remaining_total: int  # tokens until this response would stop on its own
    generated: int = 0
    version_marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (from index, version)

    def result(self, reason: str, stop_token: int | None) -> Result:
        n = self.generated
        tokens = [1 + (zlib.crc32(self.key.encode()) + len(self.request.prompt_ids) + i) % 1000 for i in range(n)]
        if reason == "stop" and stop_token is not None and n:
            tokens[-1] = stop_token
        versions = np.empty(n, np.int64)
        for j, (start, v) in enumerate(self.version_marks):
            end = self.version_marks[j + 1][0] if j + 1 < len(self.version_marks) else n
            versions[start:end] = v
        return Result(self.request.request_id, tokens, [-1.0] * n, versions.tolist(), reason)


class SimEngine(PollingEngine):
    def __init__(self, *, slots: int = 256, t0: float | None = None, c: float = 0.0, prefill_s_per_token: float = 0.00073,
                 length_scale: float = 1.0, seed: int = 0, max_model_len: int = 1 << 20, policy_version: int = 0,
                 reuse_aborted_kv: bool = False):
        self.max_num_seqs = slots
        self.t0 = 0.010 + 0.00094 * slots if t0 is None else t0
        self.c, self.p = c, prefill_s_per_token
        self.length_scale, self.seed, self.max_model_len = length_scale, seed, max_model_len
        self.policy_version = policy_version
        self.reuse_aborted_kv = reuse_aborted_kv
        self._slots: list[_Running | None] = [None] * slots
        self._queue: collections.deque[Request] = collections.deque()
        self._ready: list[Result] = []
        self._progress: dict[str, int] = {}  # sample_key -> tokens generated over all segments
        self._clock = 0.0
        self._stats = collections.Counter()
        self.timeline: list[tuple[float, int]] = []

    def submit(self, requests: Iterable[Request]) -> None:
        for r in requests:
            if (bad := self._rejected(r)) is not None:
                self._ready.append(bad)
            else:
                self._queue.append(r)

    def step(self) -> list[Result]:
        finished, self._ready = self._ready, []
        for i in range(len(self._slots)):
            if self._slots[i] is None and self._queue:
                self._slots[i] = self._admit(self._queue.popleft())
        busy = [s for s in self._slots if s is not None]
        if not busy:
            return finished
        dt = min(min(s.remaining_total, s.request.max_new_tokens) - s.generated for s in busy)
        self._clock += dt * (self.t0 + self.c * len(busy))
        self._stats["decode_steps"] += dt
        self._stats["busy_slot_steps"] += dt * len(busy)
        self._stats["tokens_generated"] += dt * len(busy)
        self.timeline.append((self._clock, len(busy)))
        for i, s in enumerate(self._slots):
            if s is None:
                continue
            s.generated += dt
            self._progress[s.key] = self._progress.get(s.key, 0) + dt
            reason = "stop" if s.generated >= s.remaining_total else "length" if s.generated >= s.request.max_new_tokens else None
            if reason:
                finished.append(s.result(reason, s.request.stop_token_ids[0] if s.request.stop_token_ids else None))
                self._slots[i] = None
        return finished

    def _admit(self, r: Request) -> _Running:
        key = r.sample_key or r.request_id
        total = draw_length(self.seed, key, self.length_scale)
        if self.reuse_aborted_kv and self._progress.get(key, 0) > 0:
            self._stats["kv_reused"] += 1  # parked KV copied back: no prefill (parking capacity not modelled)
        else:
            self._clock += self.p * len(r.prompt_ids)
            self._stats["prefill_tokens"] += len(r.prompt_ids)
        remaining = max(1, total - self._progress.get(key, 0))
        return _Running(r, key, remaining, version_marks=[(0, self.policy_version)])

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        ids = set(request_ids)
        out = [Result(r.request_id, [], [], [], "abort") for r in self._queue if r.request_id in ids]
        self._queue = collections.deque(r for r in self._queue if r.request_id not in ids)
        for i, s in enumerate(self._slots):
            if s is not None and s.request.request_id in ids:
                out.append(s.result("abort", None))
                self._slots[i] = None
        self._stats["aborted"] += len(out)
        return out

    def abort_all(self) -> list[Result]:
        return self.abort([r.request_id for r in self._queue] + [s.request.request_id for s in self._slots if s])

    def update_weights(self, params, version: int) -> None:
        self.policy_version = int(version)
        for s in self._slots:
            if s is not None:
                s.version_marks.append((s.generated, self.policy_version))

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._ready or any(s is not None for s in self._slots))

    def stats(self) -> dict:
        s = self._stats
        return {"slots": self.max_num_seqs, "busy_slots": sum(x is not None for x in self._slots),
                "queued": len(self._queue), "tokens_generated": s["tokens_generated"],
                "prefill_tokens": s["prefill_tokens"], "decode_steps": s["decode_steps"],
                "busy_slot_steps": s["busy_slot_steps"],
                "occupancy": s["busy_slot_steps"] / max(s["decode_steps"] * self.max_num_seqs, 1),
                "aborted": s["aborted"], "errors": s["errors"], "time_s": self._clock,
                "policy_version": self.policy_version}

    def limit_tokens_per_s(self) -> float:
        """Throughput with every slot busy decoding (no prefill): the ceiling."""
        return self.max_num_seqs / (self.t0 + self.c * self.max_num_seqs)

    def now(self) -> float:
        return self._clock

    def shutdown(self) -> None:
        self.abort_all()
