"""Embedded JAX rollout engine: continuous batching over fixed slots, abort with partial results.

Usage (the interface every engine implements):

    engine = JaxEngine(model, max_num_seqs=16, max_model_len=1024)
    engine.submit([Request("a", prompt_ids, max_new_tokens=256, sampling=SamplingParams(0.8))])
    while engine.has_unfinished():
        for result in engine.step():      # results come out as they finish
            ...
    partial = engine.abort(["a"])         # or engine.abort_all(): tokens generated so far
    engine.update_weights(params, version=3)

Results are polled: `step()` runs one engine iteration (refill free slots, then
`decode_steps_per_call` decode steps for every busy slot in one jitted call; rows stop on device
at their stop token or length limit) and returns the requests that finished in it; `run()`
iterates results until the engine is idle.

KV cache: contiguous, one row of `max_model_len` positions per slot (layouts in `KVCache`). Why
not paged: JAX wants static shapes, so a paged cache still needs a static page table and
gather-based attention; on CPU and at the sizes this engine serves (tens of slots, a few thousand
positions) the contiguous cache costs less compute, no indirection, and a slot is refilled by
overwriting its row. The price is memory reserved for `max_model_len` per slot; for long
contexts at high concurrency use the vLLM engine, whose paged cache is the point of it.

Prefill is batched per bucket length (powers of two up to `max_model_len`) with row counts
padded to powers of two, so the number of programs is bounded; requests with the same prompt (a
group's samples) share one prefill row. Decode is one jitted call (a `lax.scan` of steps) for the
whole batch with the cache donated. Weights swapped by `update_weights` apply from the next token
on; the KV cache of in-flight requests is kept (as vLLM does), and every token records the
version that sampled it. With `reuse_aborted_kv`, aborted rows are parked and a resume of exactly
their tokens skips the re-prefill (`kv_park.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from functools import partial
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from april_jax.models.qwen3 import KVCache, Qwen3
from april_jax.rollout import sampling
from april_jax.rollout.kv_park import KVParking
from april_jax.rollout.types import PollingEngine, Request, Result


@dataclasses.dataclass
class _Slot:
    request: Request
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def result(self, reason: str) -> Result:
        return Result(self.request.request_id, list(self.tokens), list(self.logprobs), list(self.versions), reason)


class _RowParams:
    """Per-slot decode inputs kept as host arrays, written when a slot starts and cleared when it
    ends, so a decode call does not rebuild them slot by slot. Free slots hold greedy defaults."""

    def __init__(self, num_slots: int, max_model_len: int):
        self.max_model_len = max_model_len
        self.active = np.zeros(num_slots, bool)
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_p = np.ones(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.seeds = np.zeros(num_slots, np.int32)
        self.steps = np.zeros(num_slots, np.int32)  # tokens so far, the pending first token included
        self.limits = np.zeros(num_slots, np.int32)
        self.stop_ids = np.full((num_slots, 4), -1, np.int32)  # width: a power of two, grows on demand

    def start(self, i: int, request: Request, seed: int, steps: int) -> None:
        p, stops = request.sampling, request.stop_token_ids
        if len(stops) > self.stop_ids.shape[1]:
            wider = np.full((len(self.active), 1 << (len(stops) - 1).bit_length()), -1, np.int32)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        self.active[i] = True
        self.temperature[i], self.top_p[i], self.top_k[i], self.seeds[i] = p.temperature, p.top_p, p.top_k, seed
        self.steps[i] = steps
        self.limits[i] = min(request.max_new_tokens, self.max_model_len - len(request.prompt_ids))
        self.stop_ids[i] = -1
        self.stop_ids[i, : len(stops)] = stops

    def clear(self, i: int) -> None:
        self.active[i] = False
        self.temperature[i], self.top_p[i], self.top_k[i], self.seeds[i] = 0.0, 1.0, 0, 0
        self.steps[i] = self.limits[i] = 0
        self.stop_ids[i] = -1


def _prefill(graphdef, state, cache: KVCache, next_token_S, slots_M, source_M, tokens_NT, lengths_N, temperature_M,
             top_p_M, top_k_M, seeds_M, *, mode):
    """Prefill N distinct prompts once and start M requests from them: request m takes prompt
    `source_M[m]`'s KV rows into slot `slots_M[m]` and samples its first token with its own key
    (the n samples of a group share one prefill, as vLLM's prefix cache would give). Padding
    requests carry slot index = #slots and are dropped. The first tokens also go into
    `next_token_S`, the decode step's input, so no host round trip sits between the two calls."""
    model = nnx.merge(graphdef, state)
    N, T = tokens_NT.shape
    fresh = KVCache.zeros(model.cfg, N, T, cache.v[0].dtype)
    logits_NTV, fresh = model.forward(tokens_NT, cache=fresh, num_new_B=lengths_N, fresh_cache=True)
    last_MV = jnp.take_along_axis(logits_NTV, (lengths_N - 1)[:, None, None], axis=1)[source_M, 0]
    keys = sampling.request_keys(seeds_M, jnp.zeros(source_M.shape, jnp.int32))
    tokens_M, logprobs_M = sampling.sample(last_MV, keys, temperature_M, top_p_M, top_k_M, mode=mode)
    fresh_M = KVCache(*jax.tree.map(lambda x: x[source_M], (fresh.k, fresh.v, fresh.lengths_B)))
    next_token_S = next_token_S.at[slots_M].set(tokens_M, mode="drop")
    return cache.put_rows(slots_M, fresh_M), tokens_M, logprobs_M, next_token_S


def _decode(graphdef, state, cache: KVCache, tokens_B, active_B, temperature_B, top_p_B, top_k_B, seeds_B, steps_B,
            limits_B, stop_ids_BP, *, mode, num_steps):
    """`num_steps` decode steps in one call. A row stops (and its cache stops growing) after a stop
    token or when its token count reaches `limits_B`, the same rules the host applies; the outputs
    are [num_steps, B] tokens, logprobs and whether the row was active at that step."""
    model = nnx.merge(graphdef, state)

    def one_step(carry, _):
        cache, tokens_B, active_B, steps_B = carry
        logits_B1V, cache = model.forward(tokens_B[:, None], cache=cache, num_new_B=active_B.astype(jnp.int32))
        keys = sampling.request_keys(seeds_B, steps_B)
        new_B, logprobs_B = sampling.sample(logits_B1V[:, 0], keys, temperature_B, top_p_B, top_k_B, mode=mode)
        steps_B = steps_B + active_B.astype(jnp.int32)
        done_B = jnp.any(new_B[:, None] == stop_ids_BP, axis=-1) | (steps_B >= limits_B)
        carry = (cache, jnp.where(active_B, new_B, tokens_B), active_B & ~done_B, steps_B)
        return carry, (new_B, logprobs_B, active_B)

    (cache, *_), (tokens_KB, logprobs_KB, active_KB) = jax.lax.scan(
        one_step, (cache, tokens_B, active_B, steps_B), None, length=num_steps)
    return cache, tokens_KB, logprobs_KB, active_KB


@functools.lru_cache(maxsize=16)
def compiled_steps(graphdef):
    """(prefill, decode) jitted with `graphdef` closed over: hashing a graphdef per call costs ms."""
    jit = lambda f, static: jax.jit(partial(f, graphdef), static_argnames=static, donate_argnames=("cache",))
    return jit(_prefill, ("mode",)), jit(_decode, ("mode", "num_steps"))


def default_cache_dtype(cfg) -> jnp.dtype:
    """The model's compute dtype, except fp32 on CPU: XLA:CPU writes a row into a bf16 cache by
    converting the whole cache to fp32 and back (the decode step at batch 64 took 1.5x longer).
    Nothing is lost: keys and values are computed in the compute dtype, so fp32 holds them exactly."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(cfg.dtype)


def prefill_buckets(max_model_len: int, smallest: int = 16) -> tuple[int, ...]:
    buckets, b = [], smallest
    while b < max_model_len:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_model_len,)


class JaxEngine(PollingEngine):
    def __init__(self, model: Qwen3, *, max_num_seqs: int = 16, max_model_len: int = 1024, seed: int = 0,
                 policy_version: int = 0, cache_dtype=None, min_prefill_batch: int = 1, decode_steps_per_call: int = 8,
                 reuse_aborted_kv: bool = False, samples_per_prompt: int = 1, free_kv_in_sleep: bool = True):
        if max_num_seqs <= 0 or max_model_len <= 1 or decode_steps_per_call <= 0:
            raise ValueError(f"JaxEngine: max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, "
                             f"decode_steps_per_call={decode_steps_per_call} must be positive")
        self.graphdef, self._state = nnx.split(model)
        self._prefill, self._decode = compiled_steps(self.graphdef)
        self.cfg = model.cfg
        self.max_num_seqs = max_num_seqs
        # Refill only when this many slots are free (or the queue is that short, or the engine is
        # idle): one prefill call per freed slot costs more than the decode step on small models.
        self.min_prefill_batch = max(1, min_prefill_batch)
        # Decode steps per jitted call (vLLM's multi-step scheduling): the host loop, transfers and
        # dispatch are paid once per call; free slots are refilled and aborts land between calls.
        self.decode_steps_per_call = decode_steps_per_call
        # Requests with the same prompt share one prefill row; a refill of M rows prefills either M
        # rows or M / share rows (two programs per row count, all compiled by `warmup`).
        self.prefill_share = 1 << (max(samples_per_prompt, 1) - 1).bit_length()
        self.max_model_len = max_model_len
        self.buckets = prefill_buckets(max_model_len)
        self.policy_version = policy_version
        self._cache = KVCache.zeros(self.cfg, max_num_seqs, max_model_len, cache_dtype or default_cache_dtype(self.cfg))
        self._cache_dtype = self._cache.v[0].dtype
        # `sleep` frees the KV cache while the trainer steps (verl's free_cache_engine); off keeps it.
        self.free_kv_in_sleep = free_kv_in_sleep
        self._asleep = False
        # Opt-in: aborted rows wait in a side cache and a resume of exactly their tokens skips the
        # re-prefill (see kv_park.py for what that trades).
        self._parking = KVParking(self.cfg, max_num_seqs, max_model_len, self._cache_dtype) \
            if reuse_aborted_kv else None
        self._slots: list[_Slot | None] = [None] * max_num_seqs
        self._rows = _RowParams(max_num_seqs, max_model_len)
        self._queue: collections.deque[tuple[Request, int]] = collections.deque()
        self._ready: list[Result] = []  # finished outside a step (bad requests)
        self._seeds = np.random.default_rng(seed)
        self._next_token = np.zeros(max_num_seqs, np.int32)
        self._next_token_dev = None  # device copy with first tokens of this step's prefills
        self._pending: list[tuple[list, jax.Array, jax.Array]] = []  # (items, first tokens, logprobs)
        self._t0 = time.perf_counter()
        self._stats = collections.Counter()
        self.timeline: list[tuple[float, int]] = []  # (seconds since start, busy slots) per decode step

    # ---- interface ----
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests. A bad one finishes at once with finish_reason 'error' and a reason."""
        for request in requests:
            if (bad := self._rejected(request)) is not None:
                self._ready.append(bad)
                continue
            seed = request.sampling.seed
            self._queue.append((request, int(self._seeds.integers(2**31)) if seed is None else int(seed)))

    def step(self) -> list[Result]:
        """Refill free slots, run one decode step; the results that finished in it."""
        if self._asleep:
            raise RuntimeError("JaxEngine.step while asleep: call wake_up() first")
        t = time.perf_counter()
        finished, self._ready = self._ready, []
        free = [i for i, s in enumerate(self._slots) if s is None]
        enough = len(free) >= min(self.min_prefill_batch, len(self._queue)) or len(free) == self.max_num_seqs
        if self._queue and free and enough:
            self._start([(slot, *self._queue.popleft()) for slot in free[: len(self._queue)]], finished)
        busy = [i for i, s in enumerate(self._slots) if s is not None]
        if busy:
            self._decode_step(busy, finished)
        self._stats["time_s"] += time.perf_counter() - t
        return finished

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        """Stop these requests; their results hold exactly the tokens generated so far."""
        ids = set(request_ids)
        out = [Result(r.request_id, [], [], [], "abort") for r, _ in self._queue if r.request_id in ids]
        self._queue = collections.deque((r, s) for r, s in self._queue if r.request_id not in ids)
        stopped = [i for i, slot in enumerate(self._slots) if slot is not None and slot.request.request_id in ids]
        if self._parking is not None:
            self._parking.park(self._cache, [(i, tuple(self._slots[i].request.prompt_ids) + tuple(self._slots[i].tokens))
                                             for i in stopped])
        for i in stopped:
            out.append(self._slots[i].result("abort"))
            self._end(i)
        self._stats["aborted"] += len(out)
        return out

    def abort_all(self) -> list[Result]:
        ids = [r.request_id for r, _ in self._queue] + [s.request.request_id for s in self._slots if s is not None]
        return self.abort(ids)

    def update_weights(self, params, version: int) -> None:
        """New parameters (an nnx.State of the same model, or the model; None keeps the current
        ones, a version bump only) for every later token."""
        if params is None:
            self.policy_version = int(version)
            return
        state = nnx.state(params) if isinstance(params, nnx.Module) else params
        state = jax.tree.map(lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
                             state, self._state)
        self._state = state
        self.policy_version = int(version)

    def warmup(self, modes=("greedy", "sample")) -> None:
        """Compile every prefill (bucket x power-of-two rows x shared or not) and decode program
        up front, so no compile lands inside a rollout. Costs one compile per program."""
        S = self.max_num_seqs
        for mode in modes:
            for bucket in self.buckets:
                rows = 1
                while rows <= 1 << (S - 1).bit_length():
                    z = np.zeros(rows, np.int32)
                    for prompts in sorted({rows, max(1, rows // self.prefill_share)}):
                        self._cache, *_ = self._prefill(
                            self._state, self._cache, jnp.zeros(S, jnp.int32), jnp.full(rows, S, jnp.int32),
                            jnp.arange(rows, dtype=jnp.int32) % prompts, jnp.zeros((prompts, bucket), jnp.int32),
                            jnp.ones(prompts, jnp.int32), jnp.asarray(z, jnp.float32), jnp.ones(rows, jnp.float32),
                            jnp.asarray(z), jnp.asarray(z), mode=mode)
                    rows *= 2
            zs = jnp.zeros(S, jnp.int32)
            for num_steps in self._num_steps_choices():
                self._cache, *_ = self._decode(
                    self._state, self._cache, zs, jnp.zeros(S, bool), jnp.zeros(S, jnp.float32),
                    jnp.ones(S, jnp.float32), zs, zs, zs, zs, jnp.full((S, 4), -1, jnp.int32), mode=mode,
                    num_steps=num_steps)
        self._cache = self._cache._replace(lengths_B=jnp.zeros(S, jnp.int32))

    def sleep(self) -> None:
        """Before a train step: free the KV cache (its memory goes to the trainer); parked rows move
        to host memory. The engine must be idle (APRIL aborts everything at the end of a rollout)."""
        if not self.free_kv_in_sleep or self._asleep or self._cache is None:
            return
        if self.num_unfinished():
            raise RuntimeError(f"JaxEngine.sleep: {self.num_unfinished()} requests still in flight; abort them first")
        for x in jax.tree.leaves(self._cache):
            x.delete()
        self._cache, self._next_token_dev, self._asleep = None, None, True
        if self._parking is not None:
            self._parking.offload()

    def wake_up(self) -> None:
        """After the train step: a fresh KV cache (same shape, so nothing recompiles), parked rows back."""
        if not self._asleep:
            return
        self._cache = KVCache.zeros(self.cfg, self.max_num_seqs, self.max_model_len, self._cache_dtype)
        if self._parking is not None:
            self._parking.reload()
        self._asleep = False

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._ready or any(s is not None for s in self._slots))

    def num_unfinished(self) -> int:
        return len(self._queue) + sum(s is not None for s in self._slots)

    def stats(self) -> dict:
        s = self._stats
        steps = max(s["decode_steps"], 1)
        return {
            "slots": self.max_num_seqs,
            "busy_slots": sum(x is not None for x in self._slots),
            "queued": len(self._queue),
            "tokens_generated": s["tokens_generated"],
            "prefill_tokens": s["prefill_tokens"],
            "decode_steps": s["decode_steps"],
            "decode_calls": s["decode_calls"],
            "busy_slot_steps": s["busy_slot_steps"],
            "occupancy": s["busy_slot_steps"] / (steps * self.max_num_seqs),
            "aborted": s["aborted"],
            "errors": s["errors"],
            "time_s": s["time_s"],
            "policy_version": self.policy_version,
            "kv_cache_bytes": 0 if self._cache is None else sum(x.nbytes for x in jax.tree.leaves(self._cache)),
            **{f"kv_{name}": getattr(self._parking, name, 0) for name in ("parked", "reused", "evicted")},
        }

    def now(self) -> float:
        """Seconds since the engine started (the clock APRIL measures throughput with)."""
        return time.perf_counter() - self._t0

    def shutdown(self) -> None:
        self.abort_all()
        self._cache = None
        if self._parking is not None:
            self._parking.clear()

    # ---- internals ----
    def _start(self, starting: list[tuple[int, Request, int]], finished: list[Result]) -> None:
        """Prefill new requests, grouped by bucket length; row counts padded to powers of two.
        Requests whose tokens are parked get their KV row back instead and go straight to decode."""
        if self._parking is not None and len(self._parking):
            parked, keys = [], set()
            for item in starting:
                key = tuple(item[1].prompt_ids)
                if key in self._parking and key not in keys:  # identical partials: one row, the rest prefill
                    parked.append(item)
                    keys.add(key)
            if parked:
                self._cache = self._parking.restore(self._cache, [(s, tuple(r.prompt_ids)) for s, r, _ in parked])
                for slot, request, seed in parked:
                    self._slots[slot] = _Slot(request, seed)
                    self._rows.start(slot, request, seed, 0)
                    self._next_token[slot] = request.prompt_ids[-1]  # its KV is not in the row yet
                restored = {slot for slot, _, _ in parked}
                starting = [item for item in starting if item[0] not in restored]
        by_bucket = collections.defaultdict(list)
        for item in starting:
            by_bucket[next(b for b in self.buckets if b >= len(item[1].prompt_ids))].append(item)
        for bucket, items in sorted(by_bucket.items()):
            prompts: dict[tuple, int] = {}  # distinct prompt -> its prefill row
            for _, request, _ in items:
                prompts.setdefault(tuple(request.prompt_ids), len(prompts))
            rows = 1 << (len(items) - 1).bit_length()
            shared_rows = max(1, rows // self.prefill_share)
            prefill_rows = shared_rows if len(prompts) <= shared_rows else rows
            tokens, lengths = np.zeros((prefill_rows, bucket), np.int32), np.ones(prefill_rows, np.int32)
            for prompt, r in prompts.items():
                tokens[r, : len(prompt)], lengths[r] = prompt, len(prompt)
                self._stats["prefill_tokens"] += len(prompt)
            slots = np.full(rows, self.max_num_seqs, np.int32)  # out of range: dropped
            source = np.zeros(rows, np.int32)
            temp, top_p, top_k, seeds = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32), np.zeros(rows, np.int32)
            for r, (slot, request, seed) in enumerate(items):
                sp = request.sampling
                slots[r], source[r], seeds[r] = slot, prompts[tuple(request.prompt_ids)], seed
                temp[r], top_p[r], top_k[r] = sp.temperature, sp.top_p, sp.top_k
            # Host arrays go to the jitted call as numpy: its C++ path transfers them ~5x faster
            # than jnp.asarray (which costs ~15 us an array, 17 arrays a step).
            next_token = self._next_tokens()
            self._cache, first, logprobs, self._next_token_dev = self._prefill(
                self._state, self._cache, next_token, slots, source, tokens, lengths, temp, top_p, top_k, seeds,
                mode=sampling.batch_mode(temp, top_p, top_k))
            for slot, request, seed in items:
                self._slots[slot] = _Slot(request, seed)
                self._rows.start(slot, request, seed, 1)
            self._pending.append((items, first, logprobs))

    def _next_tokens(self):
        """The decode input: the device copy holding this step's first tokens, else the host array
        (copied: the host keeps writing it while the call may still read it)."""
        return self._next_token_dev if self._next_token_dev is not None else self._next_token.copy()

    def _read_first_tokens(self, finished: list[Result]) -> None:
        """Record the first tokens of this step's prefills (read back after the decode call is queued)."""
        for items, first, logprobs in self._pending:
            first, logprobs = np.asarray(first), np.asarray(logprobs)
            for r, (slot, _, _) in enumerate(items):
                self._append(slot, [int(first[r])], [float(logprobs[r])], finished)
        self._pending = []

    def _num_steps_choices(self) -> list[int]:
        return [1 << i for i in range(self.decode_steps_per_call.bit_length()) if 1 << i <= self.decode_steps_per_call]

    def _decode_step(self, busy: list[int], finished: list[Result]) -> None:
        rows = self._rows
        # No more steps than the longest remaining request can use (a power of two bounds compiles).
        room = int((rows.limits - rows.steps)[busy].max())
        num_steps = max(n for n in self._num_steps_choices() if n <= max(room, 1))
        t0 = self.now()
        next_token = self._next_tokens()
        self._next_token_dev = None
        # Copies: the host goes on writing these arrays while the call may still read them.
        args = [x.copy() for x in (rows.active, rows.temperature, rows.top_p, rows.top_k, rows.seeds, rows.steps,
                                   rows.limits, rows.stop_ids)]
        self._cache, tokens, logprobs, was_active = self._decode(
            self._state, self._cache, next_token, *args,
            mode=sampling.batch_mode(rows.temperature, rows.top_p, rows.top_k), num_steps=num_steps)
        self._read_first_tokens(finished)  # a first token may end its request: its decode rows are dropped
        tokens, logprobs, was_active = np.asarray(tokens), np.asarray(logprobs), np.asarray(was_active)
        busy_per_step = was_active.sum(axis=1)
        dt = (self.now() - t0) / num_steps
        self.timeline.extend((t0 + (k + 1) * dt, int(n)) for k, n in enumerate(busy_per_step))
        self._stats["decode_steps"] += num_steps
        self._stats["decode_calls"] += 1
        self._stats["busy_slot_steps"] += int(busy_per_step.sum())
        # A row stops on device at its stop token or length limit, so only its last token of the
        # call can end it: per row, extend by the active prefix and check that one token.
        counts = was_active.sum(axis=0).tolist()
        tokens_BK, logprobs_BK = tokens.T.tolist(), logprobs.T.tolist()
        for i in busy:
            if self._slots[i] is not None:  # None: ended by its first token
                self._append(i, tokens_BK[i][: counts[i]], logprobs_BK[i][: counts[i]], finished)
        assert all(self._slots[i] is None for i in busy if not was_active[-1, i]), "host and device stop rules differ"

    def _append(self, i: int, tokens: list[int], logprobs: list[float], finished: list[Result]) -> None:
        """Record tokens of slot i (only the last may end the request) and end it if it should."""
        slot = self._slots[i]
        slot.tokens.extend(tokens)
        slot.logprobs.extend(logprobs)
        slot.versions.extend([self.policy_version] * len(tokens))
        token = tokens[-1]
        self._next_token[i] = token
        self._rows.steps[i] = len(slot.tokens)
        self._stats["tokens_generated"] += len(tokens)
        request = slot.request
        if token in request.stop_token_ids:
            reason = "stop"
        elif len(slot.tokens) >= request.max_new_tokens or len(request.prompt_ids) + len(slot.tokens) >= self.max_model_len:
            reason = "length"
        else:
            return
        finished.append(slot.result(reason))
        self._end(i)

    def _end(self, i: int) -> None:
        self._slots[i] = None
        self._rows.clear(i)
