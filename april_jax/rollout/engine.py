"""The rollout engine contract: what APRIL (`rollout/april.py`) and the trainer (`train.py`) call.

Three engines implement it: the embedded JAX engine (`jax_engine.JaxEngine`), the vLLM sidecar
(`vllm.engine.VllmEngine`) and the simulated one (`sim_engine.SimEngine`, and `sim_replicas.SimReplicas`
for several of them). `tests/test_engine_contract.py` runs the same checks on all of them.

The loop every caller runs:

    engine.submit(requests)               # queue; a bad request finishes at once as "error"
    while engine.has_unfinished():
        for result in engine.step():      # results come out as they finish
            ...
    partial = engine.abort_all()          # every unfinished request, with its tokens so far
    engine.sleep(); ...train...; engine.wake_up()
    engine.update_weights(params, version)  # later tokens are sampled by `params`, tagged `version`

Every `Result` holds tokens, behaviour logprobs and the policy version of each token, all of one
length. `stats()` returns cumulative counters (an `EngineStats`): callers diff two of them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from april_jax.rollout.types import Request, Result

# Decode-step points (time, busy slots) an engine keeps for plots; older ones drop off.
TIMELINE_POINTS = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """Counters since the engine started (counts unless the name ends in _s: seconds).

    `decode_steps` and `busy_slot_steps` are engine iterations and the sum over them of the
    requests decoding in each: occupancy = busy_slot_steps / (decode_steps * slots). With several
    replicas or servers both are summed over them and `slots` is one replica's."""

    slots: int  # requests one replica decodes at once
    busy_slots: int  # requests in flight now
    queued: int  # requests waiting for a slot now
    tokens_generated: int  # response tokens handed out (finished and aborted requests)
    prefill_tokens: int  # prompt tokens sent to prefill (a prefix cache may skip some of them)
    decode_steps: int  # engine iterations run
    busy_slot_steps: int  # sum over iterations of the requests decoding in each
    aborted: int  # requests stopped by abort
    errors: int  # requests refused ("error" results)
    policy_version: int  # the version new tokens are tagged with
    # Seconds in model (device) calls, for the engines that time them (JAX); None otherwise.
    model_s: float | None = None
    # Device programs launched (prefill, extend, decode, KV copies), for the engines that count
    # them (JAX): on a small model each costs about the same, whatever its batch.
    model_calls: int | None = None

    @property
    def occupancy(self) -> float:
        return self.busy_slot_steps / (self.decode_steps * self.slots) if self.decode_steps else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "occupancy": self.occupancy}


@runtime_checkable
class EngineProtocol(Protocol):
    """What APRIL and the trainer call; every engine implements exactly this (and may add more)."""

    max_num_seqs: int
    max_model_len: int
    policy_version: int
    # KV tokens the running requests share, over every server or device (APRIL's inflight="auto"
    # sizes its requests by it): the JAX engine's slots x positions, the vLLM servers' own block
    # counts; inf where it cannot be read.
    kv_budget_tokens: float

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests. One that cannot run finishes at once (finish_reason "error", a reason)."""

    def step(self) -> list[Result]:
        """Advance the engine a little; the requests that finished meanwhile."""

    def has_unfinished(self) -> bool:
        """Requests queued, running, or finished and not yet handed out."""

    def abort_all(self) -> list[Result]:
        """Stop every unfinished request: each result holds the tokens generated so far ("abort")."""

    def generate(self, requests: Iterable[Request]) -> dict[str, Result]:
        """Submit and run to completion: request id -> result."""

    def update_weights(self, params, version: int) -> None:
        """Sample every later token with `params` (an nnx.State or model) and tag it `version`.
        In-flight requests keep going; the simulated engine has no model and takes only the version."""

    def sleep(self) -> None:
        """Release accelerator memory while the trainer steps (no requests in flight)."""

    def wake_up(self) -> None:
        """Undo `sleep` before the next weight sync and rollout."""

    def stats(self) -> EngineStats:
        """Cumulative counters (diff two calls for one rollout step)."""

    def now(self) -> float:
        """Seconds on the engine's clock (wall time; simulated time for the sim engine)."""

    def rng_state(self) -> dict | None:
        """The engine's random state for a bit-identical resume (JSON-able); None if it has none."""

    def set_rng_state(self, state: dict | None) -> None:
        """Restore `rng_state()`'s value (None: nothing to restore)."""

    def shutdown(self) -> None:
        """Abort everything and release the engine's resources (servers, caches)."""


class PollingEngine:
    """Shared parts of the engines: `run` / `generate` over `submit` + `step`, the check of incoming
    requests (`max_model_len`, a `_stats` Counter), no-op sleep and random state, a bounded timeline."""

    max_model_len: int
    _stats: collections.Counter

    def _rejected(self, request: Request) -> Result | None:
        """An 'error' result naming the problem when `request` cannot run (counted), else None."""
        problem = request.validate(self.max_model_len)
        if problem is None:
            return None
        self._stats["errors"] += 1
        return Result(request.request_id, [], [], [], "error", problem)

    @staticmethod
    def _new_timeline(points: int = TIMELINE_POINTS) -> collections.deque:
        """(engine seconds, busy slots) per decode step, newest last; bounded, so a long run does not grow it."""
        return collections.deque(maxlen=points)

    def sleep(self) -> None:
        """Release accelerator memory while the trainer steps; no-op by default."""

    def wake_up(self) -> None:
        """Undo `sleep`; no-op by default."""

    def rng_state(self) -> dict | None:
        return None

    def set_rng_state(self, state: dict | None) -> None:
        """No state to restore (a resume on another engine kind is not bit-identical anyway)."""

    def run(self) -> Iterator[Result]:
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests) -> dict[str, Result]:
        self.submit(requests)
        return {r.request_id: r for r in self.run()}
