"""Data-parallel rollout on simulated replicas: one engine per GPU, groups routed whole.

As slime runs SGLang: every replica holds the whole model and its own KV budget; a router sends
each group (all members of one prompt, known from `sample_key` "group/index/attempt") to one
replica and keeps it there, so a resumed member finds its parked KV and its group's prompt
prefix. Replicas run in parallel: the set's clock is the wall clock, and `step` returns the
results of whichever replica finishes something first. An abort or a new request reaches a busy
replica at the current wall time: it first runs the whole decode steps that end by then.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from april_jax.rollout.engine import PollingEngine
from april_jax.rollout.sim_engine import SimEngine, SimEngineStats, group_of
from april_jax.rollout.types import Request, Result


class SimReplicas(PollingEngine):
    # A replica's decode step reads its running contexts, and each of its responses advances one token
    # per step: routed by request count alone, one replica can gather the long contexts, step slower
    # than the others and push its long responses past their staleness cap.
    ROUTE_CONTEXT_TOKENS = 16384

    def __init__(self, replicas: int, *, slots: int = 256, cost=None, **engine_kw):
        if replicas <= 0:
            raise ValueError(f"--replicas must be > 0, got {replicas}")
        self.replicas = [SimEngine(slots=slots, cost=cost, **engine_kw) for _ in range(replicas)]
        self.cost = self.replicas[0].cost
        self.max_num_seqs, self.max_model_len = slots, self.replicas[0].max_model_len
        self.route: dict[str, int] = {}  # group -> replica
        self._now = 0.0
        self.timeline = self._new_timeline()  # (wall clock, running requests over all replicas) per event

    @property
    def kv_budget_tokens(self) -> float:
        """KV memory of all replicas together, in tokens (APRIL's inflight="auto" sizes its requests by it)."""
        return sum(r.budget for r in self.replicas)

    @property
    def policy_version(self) -> int:
        return self.replicas[0].policy_version

    def _replica_for(self, key: str) -> SimEngine:
        group = group_of(key)
        if group not in self.route:
            # Least outstanding requests, a running context of ROUTE_CONTEXT_TOKENS counting as one
            # more; ties to the lowest index.
            load = [len(r.queue) + len(r.running) + r.running_ctx / self.ROUTE_CONTEXT_TOKENS for r in self.replicas]
            self.route[group] = min(range(len(load)), key=load.__getitem__)
        return self.replicas[self.route[group]]

    def submit(self, requests: Iterable[Request]) -> None:
        by_replica: dict[int, list[Request]] = collections.defaultdict(list)
        for r in requests:
            replica = self._replica_for(r.sample_key or r.request_id)
            replica.submit([r])  # routed one by one so the load seen by the next group counts this one
            by_replica[id(replica)].append(r)
        for replica in self.replicas:
            if id(replica) in by_replica:
                self._catch_up(replica)

    def _catch_up(self, replica: SimEngine) -> None:
        if replica.running:
            replica.advance_to(self._now)
        replica.set_clock_at_least(self._now)

    def step(self) -> list[Result]:
        out = [res for r in self.replicas for res in r.take_ready()]
        best = None
        for r in self.replicas:
            if r.idle:
                continue
            r.admit()
            event = r.next_event()
            if event is not None and (best is None or event[1] < best[2]):
                best = (r, event[0], event[1])
        if best is not None:
            best[0].run_steps(best[1])
            self._now = max(self._now, best[0].now())
            self.timeline.append((self._now, sum(len(r.running) for r in self.replicas)))
        return out + [res for r in self.replicas for res in r.take_ready()]

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        ids = set(request_ids)
        out = []
        for r in self.replicas:
            mine = [s.request.request_id for s in [*r.queue, *r.running] if s.request.request_id in ids]
            if mine:
                self._catch_up(r)
                out += r.abort(mine)
                out += r.take_ready()  # finished while catching up: reported with the aborts
        self._now = max([self._now] + [r.now() for r in self.replicas if r.idle])
        return out

    def abort_all(self) -> list[Result]:
        return self.abort([s.request.request_id for r in self.replicas for s in [*r.queue, *r.running]])

    def update_weights(self, params, version: int) -> None:
        for r in self.replicas:
            self._catch_up(r)
            r.update_weights(params, version)  # in parallel: each pays the sync on its own clock
        self._now = max(r.now() for r in self.replicas)
        for r in self.replicas:
            if r.idle:
                r.set_clock_at_least(self._now)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def now(self) -> float:
        return self._now

    def stats(self) -> SimEngineStats:
        """Counters summed over the replicas; `slots` is one replica's, peaks the largest replica's."""
        per = [r.stats() for r in self.replicas]
        summed = {
            f.name: sum(getattr(p, f.name) for p in per)
            for f in dataclasses.fields(SimEngineStats)
            if f.name
            not in ("model_s", "model_calls", "slots", "policy_version", "clock_s", "kv_tokens_peak", "kv_bytes_peak")
        }
        return SimEngineStats(
            **{
                **summed,
                "slots": self.max_num_seqs,
                "policy_version": self.policy_version,
                "clock_s": self._now,
                "kv_tokens_peak": max(p.kv_tokens_peak for p in per),
                "kv_bytes_peak": max(p.kv_bytes_peak for p in per),
            }
        )

    def shutdown(self) -> None:
        self.abort_all()
