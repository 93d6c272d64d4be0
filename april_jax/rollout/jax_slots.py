"""Per-slot host state of the JAX engine (`jax_engine.JaxEngine`): which request each slot serves,
its sampling parameters, and the tokens, logprobs and versions it has produced so far."""

from __future__ import annotations

import numpy as np

from april_jax.rollout.engine_steps import pow2_at_least
from april_jax.rollout.types import Request, Result


class Slots:
    """Per-slot state as host arrays, so the bookkeeping of a decode call (record its tokens, find
    the rows that ended, build the next call's inputs) is a few numpy operations over the busy
    slots rather than a Python loop over requests. Tokens, logprobs and versions of each slot are
    kept in [slots, max_model_len] arrays and become lists only when the request ends."""

    def __init__(self, num_slots: int, max_model_len: int):
        S, L = num_slots, max_model_len
        self.max_model_len = L
        self.requests: list[Request | None] = [None] * S
        self.slot_of: dict[str, int] = {}
        self.active = np.zeros(S, bool)
        self.temperature = np.zeros(S, np.float32)
        self.top_p = np.ones(S, np.float32)
        self.top_k = np.zeros(S, np.int32)
        self.seeds = np.zeros(S, np.int32)
        self.steps = np.zeros(S, np.int32)  # tokens so far, a pending first token included
        self.limits = np.zeros(S, np.int32)
        self.prompt_len = np.zeros(S, np.int32)
        self.stop_ids = np.full((S, 4), -1, np.int32)  # width: a power of two, grows on demand
        self.tokens = np.zeros((S, L), np.int32)
        self.logprobs = np.zeros((S, L), np.float32)
        self.versions = np.zeros((S, L), np.int64)

    def start(self, i: int, request: Request, seed: int, steps: int) -> None:
        p, stops = request.sampling, request.stop_token_ids
        if len(stops) > self.stop_ids.shape[1]:
            wider = np.full((len(self.active), pow2_at_least(len(stops))), -1, np.int32)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.requests[i] = request
        self.slot_of[request.request_id] = i
        self.active[i] = True
        self.temperature[i], self.top_p[i], self.top_k[i], self.seeds[i] = p.temperature, p.top_p, p.top_k, seed
        self.steps[i] = steps
        self.prompt_len[i] = len(request.prompt_ids)
        self.limits[i] = min(request.max_new_tokens, self.max_model_len - len(request.prompt_ids))
        self.stop_ids[i] = -1
        self.stop_ids[i, : len(stops)] = stops

    def end(self, slots) -> None:
        """Free these slots (their requests were answered). Free slots hold greedy defaults."""
        for i in slots:
            del self.slot_of[self.requests[i].request_id]
            self.requests[i] = None
        self.active[slots] = False
        self.temperature[slots], self.top_p[slots], self.top_k[slots], self.seeds[slots] = 0.0, 1.0, 0, 0
        self.steps[slots] = self.limits[slots] = self.prompt_len[slots] = 0
        self.stop_ids[slots] = -1

    def record(self, slots_N, positions_N, tokens_N, logprobs_N, version: int) -> None:
        self.tokens[slots_N, positions_N] = tokens_N
        self.logprobs[slots_N, positions_N] = logprobs_N
        self.versions[slots_N, positions_N] = version

    def ended(self, slots_N) -> tuple[np.ndarray, np.ndarray]:
        """(slots among `slots_N` whose request is over, whether each ended at a stop token)."""
        n_N = self.steps[slots_N]
        last_N = self.tokens[slots_N, np.maximum(n_N - 1, 0)]
        stop_N = np.any(self.stop_ids[slots_N] == last_N[:, None], axis=1) & (n_N > 0)
        over_N = stop_N | (n_N >= self.limits[slots_N])
        return slots_N[over_N], stop_N[over_N]

    def result(self, i: int, reason: str) -> Result:
        n = int(self.steps[i])
        return Result(
            self.requests[i].request_id,
            self.tokens[i, :n].tolist(),
            self.logprobs[i, :n].tolist(),
            self.versions[i, :n].tolist(),
            reason,
        )

    def token_ids(self, i: int) -> tuple[int, ...]:
        """Prompt + generated ids of slot i (the key its KV row is parked under)."""
        return self.requests[i].prompt_ids + tuple(self.tokens[i, : self.steps[i]].tolist())
