"""Embedded JAX rollout engine: continuous batching over fixed slots, abort with partial results.

Usage (the contract every engine implements: `rollout/engine.py`):

    engine = JaxEngine(model, max_num_seqs=16, max_model_len=1024)
    engine.submit([Request("a", prompt_ids, max_new_tokens=256, sampling=SamplingParams(0.8))])
    while engine.has_unfinished():
        for result in engine.step():      # results come out as they finish
            ...
    partial = engine.abort(["a"])         # or engine.abort_all(): tokens generated so far
    engine.update_weights(params, version=3)
    engine.stats()                        # a JaxEngineStats: counters since the start

Results are polled: `step()` runs one engine iteration (refill free slots, then
`decode_steps_per_call` decode steps for every busy slot in one jitted call; rows stop on device
at their stop token or length limit) and returns the requests that finished in it; `run()`
iterates results until the engine is idle.

KV cache: contiguous, one row of `max_model_len` positions per slot (layouts in `KVCache`). Why
not paged: JAX wants static shapes, so a paged cache still needs a static page table and
gather-based attention; on CPU and at the sizes this engine serves (tens of slots, a few thousand
positions) the contiguous cache costs less compute, no indirection, and a slot is refilled by
overwriting its row. The price is memory reserved for `max_model_len` per slot; for long
contexts at high concurrency use the vLLM engine, whose paged cache is the point of it. On a
model with a mesh the cache is made sharded by its logical axes (`KEY_AXES`...): the slots over
data x fsdp, the KV heads over tensor, so each device holds its share of the slots (the deployment
plan counts it so, `training/plan.py`).

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
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from april_jax.models.qwen3 import KVCache, Qwen3
from april_jax.models.sharding import logical_sharding
from april_jax.rollout import engine_steps, held_kv, sampling
from april_jax.rollout.engine import TIMELINE_POINTS, EngineStats, PollingEngine
from april_jax.rollout.engine_steps import bucket_for, length_buckets, pow2_at_least
from april_jax.rollout.jax_slots import Slots
from april_jax.rollout.kv_park import KVParking
from april_jax.rollout.types import Request, Result

# Cache length buckets of decode and extend calls start here: below it attention is a small part
# of a step, and every bucket is one more program per batch bucket.
SMALLEST_LENGTH_BUCKET = 64
# Suffix (extend) token buckets start here, for the same reason.
SMALLEST_SUFFIX_BUCKET = 8
# Decode and extend batch buckets start here: fewer programs, and a few idle rows cost little.
SMALLEST_ROWS_BUCKET = 4
# The KV cache's logical axes (models/sharding.py): keys [B, K, D, S], values [B, K, S, D], lengths [B].
KEY_AXES, VALUE_AXES, LENGTH_AXES = (
    ("batch", "kv_heads", "head_dim", "seq"),
    ("batch", "kv_heads", "seq", "head_dim"),
    ("batch",),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxEngineStats(EngineStats):
    """`EngineStats` plus the JAX engine's own counters. A decode step is one token for every busy slot."""

    decode_calls: int  # jitted decode calls (each up to decode_steps_per_call steps)
    computed_slot_steps: int  # slot-steps the decode calls computed (their batch buckets), busy or padding
    engine_s: float  # seconds inside the engine's methods; model_s of it in device calls
    host_s: float  # engine_s - model_s: bookkeeping, batching, Python
    kv_cache_bytes: int  # the KV cache now (0 while asleep)
    kv_parked: int  # aborted rows parked (reuse_aborted_kv)
    kv_reused: int  # resumes that took a parked row instead of a re-prefill
    kv_evicted: int  # parked rows dropped for newer ones
    prompt_copies: int  # requests that copied a busy or held slot's prompt KV instead of prefilling it


def prefill_len(request: Request) -> int:
    """The prompt positions a start prefills (or copies): a group's shared prompt
    (`Request.shared_prefix_len`) when the request carries more after it, else the whole prompt."""
    prompt, p = request.prompt_ids, request.shared_prefix_len
    return p if 0 < p < len(prompt) else len(prompt)


def default_cache_dtype(cfg) -> jnp.dtype:
    """The model's compute dtype, except fp32 on CPU: XLA:CPU writes a row into a bf16 cache by
    converting the whole cache to fp32 and back (the decode step at batch 64 took 1.5x longer).
    Nothing is lost: keys and values are computed in the compute dtype, so fp32 holds them exactly."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(cfg.dtype)


def prefill_buckets(max_model_len: int, smallest: int = 16) -> tuple[int, ...]:
    return length_buckets(max_model_len, smallest)


def merge_buckets(by_bucket: dict[int, list], rows, padding_budget: int) -> dict[int, list]:
    """Items grouped by length bucket, ascending; a bucket joins the next larger one when that
    pads at most `padding_budget` tokens (`rows(items)` x the length difference), so one call
    serves both."""
    buckets = sorted(by_bucket)
    merged: dict[int, list] = {}
    carry: list = []
    for bucket, larger in zip(buckets, buckets[1:] + [None]):
        items = carry + by_bucket[bucket]
        if larger is not None and rows(items) * (larger - bucket) <= padding_budget:
            carry = items
            continue
        merged[bucket], carry = items, []
    return merged


def cache_shardings(make_cache, mesh) -> KVCache | None:
    """NamedShardings of the cache `make_cache()` would return, from its logical axes on `mesh`
    (None: no mesh). A dimension its mesh axes do not divide is replicated (`logical_to_spec`)."""
    if mesh is None:
        return None
    shapes = jax.eval_shape(make_cache)

    def shard(axes, x):
        # trailing replicated dims left out, as the programs' outputs spell it: an equal sharding,
        # so no call meets a layout it was not compiled for
        spec = list(logical_sharding(axes, x.shape, mesh).spec)
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(mesh, PartitionSpec(*spec))

    return KVCache(
        tuple(shard(KEY_AXES, x) for x in shapes.k),
        tuple(shard(VALUE_AXES, x) for x in shapes.v),
        shard(LENGTH_AXES, shapes.lengths_B),
    )


class JaxEngine(PollingEngine):
    def __init__(
        self,
        model: Qwen3,
        *,
        max_num_seqs: int = 16,
        max_model_len: int = 1024,
        seed: int = 0,
        policy_version: int = 0,
        cache_dtype=None,
        min_prefill_batch: int = 1,
        decode_steps_per_call: int = 8,
        reuse_aborted_kv: bool = False,
        samples_per_prompt: int = 1,
        free_kv_in_sleep: bool = True,
        compact_decode: bool = True,
        timeline_points: int = TIMELINE_POINTS,
        merge_padding_tokens: int = 0,
        hold_aborted_kv: bool = False,
        smallest_prefill_bucket: int = 16,
        copy_prompt_kv: bool = True,
    ):
        if reuse_aborted_kv and hold_aborted_kv:
            raise ValueError("JaxEngine: reuse_aborted_kv and hold_aborted_kv are two ways of the same thing; pick one")
        if max_num_seqs <= 0 or max_model_len <= 1 or decode_steps_per_call <= 0:
            raise ValueError(
                f"JaxEngine: max_num_seqs={max_num_seqs}, max_model_len={max_model_len}, "
                f"decode_steps_per_call={decode_steps_per_call} must be positive"
            )
        self.graphdef, self._state = nnx.split(model)
        self._programs = engine_steps.compiled(self.graphdef)
        self.cfg = model.cfg
        self.max_num_seqs = max_num_seqs
        # Refill only when this many slots are free (or the queue is that short, or the engine is
        # idle): one prefill call per freed slot costs more than the decode step on small models.
        self.min_prefill_batch = max(1, min_prefill_batch)
        # Decode steps per jitted call (vLLM's multi-step scheduling): the host loop, transfers and
        # dispatch are paid once per call; free slots are refilled and aborts land between calls.
        self.decode_steps_per_call = decode_steps_per_call
        # Requests with the same prompt share one prefill row; a refill of M rows prefills a power
        # of two of rows from M / share to M (the programs `warmup` compiles).
        self.prefill_share = pow2_at_least(max(samples_per_prompt, 1))
        self.max_model_len = max_model_len
        # Every slot has its own max_model_len row: no context can overflow or preempt another, and
        # at most max_num_seqs requests run. APRIL's inflight='auto' caps the contexts in flight at
        # 0.85 of this, which binds only when their mean nears max_model_len.
        self.kv_budget_tokens = max_num_seqs * max_model_len
        # Prompt-length buckets of prefill calls; a larger smallest one means fewer programs to compile
        # (each (rows, prompts, length) shape is one) for some padding.
        self.buckets = prefill_buckets(max_model_len, max(1, min(smallest_prefill_bucket, max_model_len)))
        self.suffix_buckets = length_buckets(max_model_len, SMALLEST_SUFFIX_BUCKET)
        # Prefill and extend calls serve two length buckets at once when that pads at most this
        # many tokens: on a small model a call's fixed cost exceeds the padding's compute.
        self.merge_padding_tokens = merge_padding_tokens
        # Decode runs over the busy slots only, in a power-of-two batch bucket and a cache length
        # bucket; `compact_decode=False` runs every slot over the whole row (the reference path).
        self.compact_decode = compact_decode
        self.length_buckets = (
            length_buckets(max_model_len, SMALLEST_LENGTH_BUCKET) if compact_decode else (max_model_len,)
        )
        self.policy_version = policy_version
        self._cache_dtype = jnp.dtype(cache_dtype or default_cache_dtype(self.cfg))
        self._cache_shardings = cache_shardings(self._empty_cache, getattr(model, "mesh", None))
        # a mesh's cache is made where its shards belong, never whole on one device
        self._new_cache = (
            self._empty_cache
            if self._cache_shardings is None
            else jax.jit(self._empty_cache, out_shardings=self._cache_shardings)
        )
        self._cache = self._new_cache()
        # `sleep` frees the KV cache while the trainer steps (verl's free_cache_engine); off keeps it.
        self.free_kv_in_sleep = free_kv_in_sleep
        self._asleep = False
        # Opt-in: aborted rows wait in a side cache and a resume of exactly their tokens skips the
        # re-prefill (see kv_park.py for what that trades).
        self._parking = (
            KVParking(self.cfg, max_num_seqs, max_model_len, self._cache_dtype, self._cache_shardings)
            if reuse_aborted_kv
            else None
        )
        # Opt-in: an aborted row stays in its slot, held until a request with exactly its tokens
        # resumes it there (no device call at all) or its slot is needed (oldest first). Held rows
        # are lost when `sleep` frees the cache.
        self.hold_aborted_kv = hold_aborted_kv
        # A request whose prompt a busy or held slot already holds (a group member started after
        # its siblings) copies that row instead of prefilling the prompt again.
        self.copy_prompt_kv = copy_prompt_kv
        # The policy version whose weights computed each slot's prompt KV (-1: unknown): a copy
        # is taken only from the current weights', as vLLM resets its prefix cache on a weight update.
        self._prompt_kv_version = np.full(max_num_seqs, -1, np.int64)
        self._held: dict[tuple, list[int]] = {}  # tokens -> the slots holding them (identical partials: several)
        self._held_order: collections.OrderedDict[int, tuple] = (
            collections.OrderedDict()
        )  # slot -> tokens, oldest first
        self._held_mask = np.zeros(max_num_seqs, bool)
        self._slots = Slots(max_num_seqs, max_model_len)
        self._queue: collections.deque[tuple[Request, int]] = collections.deque()
        self._ready: list[Result] = []  # finished outside a step (bad requests)
        self._seeds = np.random.default_rng(seed)
        self._next_token = np.zeros(max_num_seqs, np.int32)
        self._next_token_dev = None  # device copy with first tokens of this step's prefills
        self._pending: list[tuple[np.ndarray, jax.Array, jax.Array]] = []  # (slots, first tokens, logprobs)
        self._t0 = time.perf_counter()
        self._stats = collections.Counter()
        self.timeline = self._new_timeline(timeline_points)  # (seconds since start, busy slots) per decode step

    # ---- interface ----
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests. A bad one finishes at once with finish_reason 'error' and a reason."""
        t = time.perf_counter()
        for request in requests:
            if (bad := self._rejected(request)) is not None:
                self._ready.append(bad)
                continue
            seed = request.sampling.seed
            self._queue.append((request, int(self._seeds.integers(2**31)) if seed is None else int(seed)))
        self._stats["engine_s"] += time.perf_counter() - t

    def step(self) -> list[Result]:
        """Refill free slots, run one decode call; the results that finished in it."""
        if self._asleep:
            raise RuntimeError("JaxEngine.step while asleep: call wake_up() first")
        t = time.perf_counter()
        finished, self._ready = self._ready, []
        if self._held and self._queue:
            self._resume_held()
        free = np.flatnonzero(~self._slots.active & ~self._held_mask)
        if self._held_order and len(self._queue) > len(free):
            self._release_held(len(self._queue) - len(free))
            free = np.flatnonzero(~self._slots.active & ~self._held_mask)
        enough = len(free) >= min(self.min_prefill_batch, len(self._queue)) or not self._slots.active.any()
        if self._queue and len(free) and enough:
            self._start([(int(slot), *self._queue.popleft()) for slot in free[: len(self._queue)]])
        busy = np.flatnonzero(self._slots.active)
        if len(busy):
            self._decode_step(busy, finished)
        self._stats["engine_s"] += time.perf_counter() - t
        return finished

    def abort(self, request_ids: Iterable[str]) -> list[Result]:
        """Stop these requests; their results hold exactly the tokens generated so far."""
        t = time.perf_counter()
        ids = set(request_ids)
        out = [Result(r.request_id, [], [], [], "abort") for r, _ in self._queue if r.request_id in ids]
        if out:
            self._queue = collections.deque((r, s) for r, s in self._queue if r.request_id not in ids)
        slots = self._slots
        stopped = sorted(slots.slot_of[rid] for rid in ids if rid in slots.slot_of)
        if self._parking is not None and stopped:
            m = time.perf_counter()
            self._parking.park(self._cache, [(i, slots.token_ids(i)) for i in stopped])
            self._stats["model_s"] += time.perf_counter() - m
            self._stats["model_calls"] += 1
        if self.hold_aborted_kv:
            for i in stopped:
                key = slots.token_ids(i)
                self._held.setdefault(key, []).append(i)
                self._held_order[i] = key
                self._held_mask[i] = True
                self._stats["kv_parked"] += 1
        out += [slots.result(i, "abort") for i in stopped]
        slots.end(stopped)
        self._stats["aborted"] += len(out)
        self._stats["engine_s"] += time.perf_counter() - t
        return out

    def abort_all(self) -> list[Result]:
        ids = [r.request_id for r, _ in self._queue] + list(self._slots.slot_of)
        return self.abort(ids)

    def update_weights(self, params, version: int) -> None:
        """New parameters (an nnx.State of the same model, or the model) for every later token."""
        if params is None:
            raise TypeError("JaxEngine.update_weights: params is None (pass the policy's nnx.State or model)")
        state = nnx.state(params) if isinstance(params, nnx.Module) else params
        state = jax.tree.map(
            lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype), state, self._state
        )
        self._state = state
        self.policy_version = int(version)

    def warmup(self, modes=("greedy", "sample")) -> None:
        """Compile every prefill (bucket x power-of-two rows x shared or not) and decode program
        (batch bucket x length bucket) up front, so no compile lands inside a rollout. Extend
        programs (resumed requests' suffixes) compile when first used."""
        S, P = self.max_num_seqs, self._programs
        for mode in modes:
            for bucket in self.buckets:
                for rows in self._batch_buckets():
                    z = np.zeros(rows, np.int32)
                    for prompts in self._prefill_row_counts(rows):
                        self._cache, *_ = P.prefill(
                            self._state,
                            self._cache,
                            jnp.zeros(S, jnp.int32),
                            jnp.full(rows, S, jnp.int32),
                            jnp.arange(rows, dtype=jnp.int32) % prompts,
                            jnp.zeros((prompts, bucket), jnp.int32),
                            jnp.ones(prompts, jnp.int32),
                            jnp.asarray(z, jnp.float32),
                            jnp.ones(rows, jnp.float32),
                            jnp.asarray(z),
                            jnp.asarray(z),
                            mode=mode,
                        )
            # static arguments spelled as `_decode_step` passes them: a keyword left to its default is
            # another jit cache key, and the first real call would trace the program again
            for rows in sorted({self._rows_bucket(n) for n in range(1, S + 1)}):
                z = np.zeros(rows, np.int32)
                for length in self.length_buckets:
                    self._cache, *_ = P.decode(
                        self._state,
                        self._cache,
                        jnp.zeros(S, jnp.int32),
                        np.full(rows, S, np.int32),
                        np.zeros(rows, bool),
                        z.astype(np.float32),
                        np.ones(rows, np.float32),
                        z,
                        z,
                        z,
                        z,
                        np.full((rows, self._slots.stop_ids.shape[1]), -1, np.int32),
                        np.int32(1),
                        mode=mode,
                        num_positions=length,
                        steps_per_call=self.decode_steps_per_call,
                        in_place=False,
                    )
            if self.compact_decode:  # every slot busy: the in-place program (see _decode_step)
                z = np.zeros(S, np.int32)
                self._cache, *_ = P.decode(
                    self._state,
                    self._cache,
                    jnp.zeros(S, jnp.int32),
                    np.arange(S, dtype=np.int32),
                    np.zeros(S, bool),
                    z.astype(np.float32),
                    np.ones(S, np.float32),
                    z,
                    z,
                    z,
                    z,
                    np.full((S, self._slots.stop_ids.shape[1]), -1, np.int32),
                    np.int32(1),
                    mode=mode,
                    num_positions=self.max_model_len,
                    steps_per_call=self.decode_steps_per_call,
                    in_place=True,
                )
        if self.copy_prompt_kv:
            for rows in self._batch_buckets():
                z = np.zeros(rows, np.int32)
                self._cache = P.copy_rows(self._cache, z, np.full(rows, S, np.int32), z)
        self._cache = self._placed(self._cache._replace(lengths_B=jnp.zeros(S, jnp.int32)))

    def sleep(self) -> None:
        """Before a train step: free the KV cache (its memory goes to the trainer); parked rows move
        to host memory. The engine must be idle (APRIL aborts everything at the end of a rollout)."""
        if not self.free_kv_in_sleep or self._asleep or self._cache is None:
            return
        if self.num_unfinished():
            raise RuntimeError(f"JaxEngine.sleep: {self.num_unfinished()} requests still in flight; abort them first")
        self._release_held(len(self._held_order))
        for x in jax.tree.leaves(self._cache):
            x.delete()
        self._cache, self._next_token_dev, self._asleep = None, None, True
        if self._parking is not None:
            self._parking.offload()

    def wake_up(self) -> None:
        """After the train step: a fresh KV cache (same shape, so nothing recompiles), parked rows back."""
        if not self._asleep:
            return
        self._cache = self._new_cache()
        if self._parking is not None:
            self._parking.reload()
        self._asleep = False

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._ready or self._slots.slot_of)

    def num_unfinished(self) -> int:
        return len(self._queue) + len(self._slots.slot_of)

    def stats(self) -> JaxEngineStats:
        s = self._stats
        return JaxEngineStats(
            slots=self.max_num_seqs,
            busy_slots=len(self._slots.slot_of),
            queued=len(self._queue),
            tokens_generated=s["tokens_generated"],
            prefill_tokens=s["prefill_tokens"],
            decode_steps=s["decode_steps"],
            busy_slot_steps=s["busy_slot_steps"],
            aborted=s["aborted"],
            errors=s["errors"],
            policy_version=self.policy_version,
            model_s=s["model_s"],
            model_calls=s["model_calls"],
            decode_calls=s["decode_calls"],
            computed_slot_steps=s["computed_slot_steps"],
            engine_s=s["engine_s"],
            host_s=s["engine_s"] - s["model_s"],
            kv_cache_bytes=0 if self._cache is None else sum(x.nbytes for x in jax.tree.leaves(self._cache)),
            prompt_copies=s["prompt_copies"],
            **{
                f"kv_{name}": getattr(self._parking, name, 0) + s[f"kv_{name}"]
                for name in ("parked", "reused", "evicted")
            },
        )

    def rng_state(self) -> dict:
        """The request-seed generator's state (JSON-able); a checkpoint keeps it for a bit-identical resume."""
        return self._seeds.bit_generator.state

    def set_rng_state(self, state: dict | None) -> None:
        """Restore `rng_state()`; None (a fresh run, or a checkpoint of an engine without one) keeps the seed's."""
        if state is not None:
            self._seeds.bit_generator.state = state

    def now(self) -> float:
        """Seconds since the engine started (the clock APRIL measures throughput with)."""
        return time.perf_counter() - self._t0

    def shutdown(self) -> None:
        self.abort_all()
        self._release_held(len(self._held_order))
        self._cache = None
        if self._parking is not None:
            self._parking.clear()

    # ---- internals ----
    def _empty_cache(self) -> KVCache:
        return KVCache.zeros(self.cfg, self.max_num_seqs, self.max_model_len, self._cache_dtype)

    def _placed(self, cache: KVCache) -> KVCache:
        """`cache` on the cache's shardings (a no-op where it is already), so no program meets a new layout."""
        return cache if self._cache_shardings is None else jax.device_put(cache, self._cache_shardings)

    def _batch_buckets(self, smallest: int = 1) -> list[int]:
        """Row counts of calls: powers of two from `smallest`, the last one `max_num_seqs`."""
        S = self.max_num_seqs
        return sorted({min(max(1 << i, smallest), S) for i in range((S - 1).bit_length() + 1)})

    def _prefill_row_counts(self, rows: int) -> list[int]:
        """The prefill row counts a start of `rows` requests may use: powers of two from rows / share."""
        counts, n = [], max(1, rows // self.prefill_share)
        while n < rows:
            counts.append(n)
            n *= 2
        return counts + [rows]

    def _rows_bucket(self, n: int) -> int:
        """Row count of a decode or extend call over n busy rows."""
        if not self.compact_decode:
            return self.max_num_seqs
        return pow2_at_least(max(n, SMALLEST_ROWS_BUCKET), self.max_num_seqs)

    def _start(self, starting: list[tuple[int, Request, int]]) -> None:
        """Start requests in free slots. Parked rows come back without a prefill. The rest are
        prefilled from their shared prefix (`Request.shared_prefix_len`, a group's prompt; else
        the whole prompt), one prefill row per distinct prefix, one call per length bucket (or
        per merged buckets, `merge_padding_tokens`); the requests with more tokens after that
        prefix (resumed members) then take those tokens in one extend call per suffix bucket."""
        if self._parking is not None and len(self._parking):
            starting = self._restore_parked(starting)
        suffixed = []
        if self.copy_prompt_kv and (self._slots.active.any() or self._held_order):
            starting, suffixed = self._copy_resident_prompts(starting)
        by_bucket = collections.defaultdict(list)
        for item in starting:
            prompt, prefix_len = item[1].prompt_ids, prefill_len(item[1])
            by_bucket[bucket_for(prefix_len, self.buckets)].append((*item, prefix_len))
            if prefix_len < len(prompt):
                suffixed.append((*item, prefix_len))
        slots = self._slots
        distinct_prefixes = lambda items: len({request.prompt_ids[:n] for _, request, _, n in items})
        for bucket, items in merge_buckets(by_bucket, distinct_prefixes, self.merge_padding_tokens).items():
            # Requests prefilled whole first: the first tokens of the leading rows are theirs.
            items.sort(key=lambda item: item[3] < len(item[1].prompt_ids))
            whole = sum(n == len(request.prompt_ids) for _, request, _, n in items)
            prefixes: dict[tuple, int] = {}  # distinct prefix -> its prefill row
            for _, request, _, n in items:
                prefixes.setdefault(request.prompt_ids[:n], len(prefixes))
            rows = pow2_at_least(len(items), self.max_num_seqs)
            # a power of two of rows, from rows / share (every group whole) up to rows
            prefill_rows = min(rows, max(rows // self.prefill_share, pow2_at_least(len(prefixes)), 1))
            tokens, lengths = np.zeros((prefill_rows, bucket), np.int32), np.ones(prefill_rows, np.int32)
            for prefix, r in prefixes.items():
                tokens[r, : len(prefix)], lengths[r] = prefix, len(prefix)
                self._stats["prefill_tokens"] += len(prefix)
            slot_M = np.full(rows, self.max_num_seqs, np.int32)  # out of range: dropped
            source = np.zeros(rows, np.int32)
            slot_M[: len(items)] = [slot for slot, *_ in items]
            source[: len(items)] = [prefixes[request.prompt_ids[:n]] for _, request, _, n in items]
            for slot, request, seed, _ in items:
                slots.start(slot, request, seed, 1)
                self._prompt_kv_version[slot] = self.policy_version
            args = self._sampling_args(slot_M[: len(items)], rows)
            # Host arrays go to the jitted call as numpy: its C++ path transfers them ~5x faster
            # than jnp.asarray.
            self._cache, first, logprobs, self._next_token_dev = self._device(
                self._programs.prefill,
                self._state,
                self._cache,
                self._next_tokens(),
                slot_M,
                source,
                tokens,
                lengths,
                *args,
                mode=sampling.batch_mode(*args[:3]),
            )
            if whole:
                self._pending.append((slot_M[:whole], first, logprobs))
        # One extend call per suffix bucket: a call computes rows x its longest suffix, so resumed
        # members of a few tokens would otherwise pay for the longest partial of the step.
        by_suffix = collections.defaultdict(list)
        for item in suffixed:
            by_suffix[bucket_for(len(item[1].prompt_ids) - item[3], self.suffix_buckets)].append(item)
        for T, items in merge_buckets(by_suffix, len, self.merge_padding_tokens).items():
            self._extend(items, T)

    def _extend(self, items: list[tuple[int, Request, int, int]], T: int) -> None:
        rows = self._rows_bucket(len(items))
        slot_M = np.full(rows, self.max_num_seqs, np.int32)
        tokens, lengths = np.zeros((rows, T), np.int32), np.ones(rows, np.int32)
        for r, (slot, request, _, n) in enumerate(items):
            suffix = request.prompt_ids[n:]
            slot_M[r], tokens[r, : len(suffix)], lengths[r] = slot, suffix, len(suffix)
            self._stats["prefill_tokens"] += len(suffix)
        num_positions = bucket_for(max(len(request.prompt_ids) for _, request, _, _ in items), self.length_buckets)
        args = self._sampling_args(slot_M[: len(items)], rows)
        self._cache, first, logprobs, self._next_token_dev = self._device(
            self._programs.extend,
            self._state,
            self._cache,
            self._next_tokens(),
            slot_M,
            tokens,
            lengths,
            *args,
            mode=sampling.batch_mode(*args[:3]),
            num_positions=num_positions,
        )
        self._pending.append((slot_M[: len(items)], first, logprobs))

    def _device(self, program, *args, **kw):
        """Dispatch a device program, its time counted as the model's."""
        t = time.perf_counter()
        out = program(*args, **kw)
        self._stats["model_s"] += time.perf_counter() - t
        self._stats["model_calls"] += 1
        return out

    def _restore_parked(self, starting):
        """Slots whose prompt is exactly a parked row's tokens get that row back (identical
        partials: one row, the rest prefill); returns the others."""
        parked, keys = [], set()
        for item in starting:
            key = item[1].prompt_ids
            if key in self._parking and key not in keys:
                parked.append(item)
                keys.add(key)
        if not parked:
            return starting
        self._cache = self._device(self._parking.restore, self._cache, [(s, r.prompt_ids) for s, r, _ in parked])
        for slot, request, seed in parked:
            self._slots.start(slot, request, seed, 0)
            self._prompt_kv_version[slot] = -1  # parked under weights since replaced, maybe
            self._next_token[slot] = request.prompt_ids[-1]  # its KV is not in the row yet
        restored = {slot for slot, _, _ in parked}
        return [item for item in starting if item[0] not in restored]

    def _copy_resident_prompts(self, starting):
        """Requests whose prompt a busy or held slot already holds copy that row instead of
        prefilling: a whole prompt's last token becomes the first decode input (as a held row
        resumes); a resumed member (the group's prompt + its partial response,
        `Request.shared_prefix_len`) copies the group's prompt and extends its own suffix.
        Returns (the requests still to prefill, the copied ones to extend)."""
        s = self._slots
        lengths = {prefill_len(request) for _, request, _ in starting}
        current = self._prompt_kv_version == self.policy_version
        # a busy row serves its prompt's positions (what a sibling's prompt can match)
        rows = [
            (int(i), s.requests[i].prompt_ids, int(s.prompt_len[i] + s.steps[i]) - 1)
            for i in np.flatnonzero(s.active & current)
        ]
        rows += [(slot, key, len(key) - 1) for slot, key in self._held_order.items() if current[slot]]
        resident: dict[tuple, int] = {}  # prompt -> a slot whose row holds its KV
        for slot, tokens, cached in rows:
            for n in lengths:
                if cached >= n:
                    resident.setdefault(tokens[:n], slot)
        copies, rest, suffixed = [], [], []
        for slot, request, seed in starting:
            n = prefill_len(request)
            keep = n if n < len(request.prompt_ids) else n - 1  # a whole prompt decodes its last token
            source = resident.get(request.prompt_ids[:n]) if n >= 2 else None
            if source is None:
                rest.append((slot, request, seed))
                continue
            copies.append((source, slot, keep))
            self._prompt_kv_version[slot] = self.policy_version
            if keep == n:  # the suffix follows in an extend call, which samples the first token
                s.start(slot, request, seed, 1)
                suffixed.append((slot, request, seed, n))
            else:
                s.start(slot, request, seed, 0)
                self._next_token[slot] = request.prompt_ids[-1]
        if copies:
            rows_N = pow2_at_least(len(copies), self.max_num_seqs)
            src, dst, keep = (
                np.zeros(rows_N, np.int32),
                np.full(rows_N, self.max_num_seqs, np.int32),
                np.zeros(rows_N, np.int32),
            )
            src[: len(copies)], dst[: len(copies)], keep[: len(copies)] = zip(*copies)
            self._cache = self._device(self._programs.copy_rows, self._cache, src, dst, keep)
            self._stats["prompt_copies"] += len(copies)
        return rest, suffixed

    def _resume_held(self) -> None:
        """Queued requests whose prompt is exactly a held row's tokens continue in that slot: its
        KV holds all but the last token, which becomes the next decode input."""
        waiting = collections.deque()
        for request, seed in self._queue:
            slots = self._held.get(request.prompt_ids)
            if not slots:
                waiting.append((request, seed))
                continue
            slot = slots.pop()
            if not slots:
                del self._held[request.prompt_ids]
            del self._held_order[slot]
            self._held_mask[slot] = False
            self._slots.start(slot, request, seed, 0)
            self._next_token[slot] = request.prompt_ids[-1]
            self._stats["kv_reused"] += 1
        self._queue = waiting

    def held_kv_snapshot(self) -> dict | None:
        """The held rows (slots, tokens, KV) copied to host memory; `held_kv.to_json` makes it a
        checkpoint's. None when nothing is held (or too much to save: held_kv.MAX_SAVED_BYTES)."""
        return held_kv.snapshot(self._cache, list(self._held_order.items()))

    def restore_held_kv(self, state: dict | None) -> str | None:
        """Hold again the rows of `held_kv.to_json(held_kv_snapshot())` (a resumed run: the engine fresh, nothing held);
        why they do not fit this engine (its requests then re-prefill), or None."""
        if not state or not self.hold_aborted_kv:
            return None  # nothing saved, or a run resumed without holding: its requests re-prefill
        if self._held_order or self._slots.slot_of or self._cache is None:
            raise RuntimeError("JaxEngine.restore_held_kv: the engine must be fresh and awake")
        problem = held_kv.check(state, self._cache)
        if problem:
            return problem
        try:
            self._cache, held = held_kv.restore(self._cache, state)
        except (ValueError, KeyError, TypeError) as e:  # bad base64, bytes that do not fill the shape
            return f"held KV: unreadable ({e})"
        self._cache = self._placed(self._cache)  # eager updates may leave another layout: the programs' own
        for slot, key in held:
            self._prompt_kv_version[slot] = -1  # a checkpoint's: the weights that made it are not known here
            self._held.setdefault(key, []).append(slot)
            self._held_order[slot] = key
            self._held_mask[slot] = True
        return None

    def release_held(self) -> None:
        """Drop every held row (their requests, if resumed, re-prefill). train.py calls it after a
        checkpoint, so that a run resumed from it (which holds nothing) equals the uninterrupted one."""
        self._release_held(len(self._held_order))

    def _release_held(self, count: int) -> None:
        """Free the `count` oldest held rows."""
        for _ in range(min(count, len(self._held_order))):
            slot, key = self._held_order.popitem(last=False)
            self._held[key].remove(slot)
            if not self._held[key]:
                del self._held[key]
            self._held_mask[slot] = False
            self._stats["kv_evicted"] += 1

    def _sampling_args(self, slots_N, rows: int):
        """(temperature, top_p, top_k, seeds) of these slots, padded to `rows` with greedy rows."""
        s, n = self._slots, len(slots_N)
        out = []
        for x, pad in ((s.temperature, 0.0), (s.top_p, 1.0), (s.top_k, 0), (s.seeds, 0)):
            padded = np.full(rows, pad, x.dtype)
            padded[:n] = x[slots_N]
            out.append(padded)
        return out

    def _next_tokens(self):
        """The decode input: the device copy holding this step's first tokens, else the host array
        (copied: the host keeps writing it while the call may still read it)."""
        return self._next_token_dev if self._next_token_dev is not None else self._next_token.copy()

    def _read_first_tokens(self, finished: list[Result]) -> float:
        """Record the first tokens of this step's prefills (read back after the decode call is
        queued); returns the seconds spent waiting for the prefills to compute them."""
        slots, waited = self._slots, 0.0
        for slots_N, first, logprobs in self._pending:
            t = time.perf_counter()
            first, logprobs = np.asarray(first)[: len(slots_N)], np.asarray(logprobs)[: len(slots_N)]
            waited += time.perf_counter() - t
            slots.record(slots_N, np.zeros(len(slots_N), np.int32), first, logprobs, self.policy_version)
            self._next_token[slots_N] = first
            self._stats["tokens_generated"] += len(slots_N)
            self._finish(slots_N, finished)
        self._pending = []
        return waited

    def _finish(self, slots_N, finished: list[Result]) -> None:
        done, at_stop = self._slots.ended(slots_N)
        finished += [self._slots.result(int(i), "stop" if stop else "length") for i, stop in zip(done, at_stop)]
        self._slots.end(done)

    def _decode_step(self, busy: np.ndarray, finished: list[Result]) -> None:
        t = time.perf_counter()
        s, n, S = self._slots, len(busy), self.max_num_seqs
        rows = self._rows_bucket(n)
        if self.compact_decode:
            rows_B = np.full(rows, S, np.int32)
            rows_B[:n] = busy
        else:
            rows_B = np.arange(S, dtype=np.int32)
        pick = np.minimum(rows_B, S - 1)
        # Copies (fancy indexing): the host goes on writing these arrays while the call may read them.
        active_B = s.active[pick] & (rows_B < S)
        # No more steps than the longest remaining request can use; the length bucket holds every
        # row's cache (prompt + tokens - the pending one) plus the steps of this call.
        max_steps = min(self.decode_steps_per_call, max(int((s.limits - s.steps)[busy].max()), 1))
        need = int((s.prompt_len + s.steps - 1)[busy].max()) + max_steps
        num_positions = bucket_for(min(need, self.max_model_len), self.length_buckets)
        # Every slot's row in the call: decode the cache where it lies (no gather of the rows, no
        # scatter back) when its whole length costs at most twice the length bucket.
        in_place = self.compact_decode and rows == S and self.max_model_len <= 2 * num_positions
        if in_place:
            rows_B = pick = np.arange(S, dtype=np.int32)
            active_B = s.active.copy()
            num_positions = self.max_model_len
        args = [
            s.temperature[pick],
            s.top_p[pick],
            s.top_k[pick],
            s.seeds[pick],
            s.steps[pick],
            s.limits[pick],
            s.stop_ids[pick],
        ]
        t0 = self.now()
        self._cache, tokens, logprobs, was_active = self._programs.decode(
            self._state,
            self._cache,
            self._next_tokens(),
            rows_B,
            active_B,
            *args,
            np.int32(max_steps),
            mode=sampling.batch_mode(s.temperature[busy], s.top_p[busy], s.top_k[busy]),
            num_positions=num_positions,
            steps_per_call=self.decode_steps_per_call,
            in_place=in_place,
        )
        self._next_token_dev = None
        host = time.perf_counter()
        waited = self._read_first_tokens(finished)  # a first token may end its request: its decode rows are dropped
        host = time.perf_counter() - host - waited  # waiting for the prefills is the model's time
        tokens, logprobs, was_active = np.asarray(tokens), np.asarray(logprobs), np.asarray(was_active)
        self._stats["model_s"] += time.perf_counter() - t - host
        if in_place or not self.compact_decode:
            tokens, logprobs, was_active = tokens[:, busy], logprobs[:, busy], was_active[:, busy]
        tokens, logprobs, was_active = tokens[:, :n], logprobs[:, :n], was_active[:, :n]
        ran = int(was_active.any(axis=1).sum())
        busy_per_step = was_active[:ran].sum(axis=1)
        dt = (self.now() - t0) / max(ran, 1)
        self.timeline.extend((t0 + (k + 1) * dt, int(b)) for k, b in enumerate(busy_per_step))
        self._stats["decode_steps"] += ran
        self._stats["decode_calls"] += 1
        self._stats["model_calls"] += 1
        self._stats["busy_slot_steps"] += int(busy_per_step.sum())
        self._stats["computed_slot_steps"] += ran * len(rows_B)
        # Rows ended by their first token (already answered) drop their decode output.
        alive = s.active[busy]
        was_active = was_active & alive[None]
        k_N, b_N = np.nonzero(was_active)
        s.record(busy[b_N], s.steps[busy][b_N] + k_N, tokens[k_N, b_N], logprobs[k_N, b_N], self.policy_version)
        counts = was_active.sum(axis=0)
        s.steps[busy] += counts.astype(np.int32)
        self._next_token[busy[alive]] = s.tokens[busy[alive], np.maximum(s.steps[busy[alive]] - 1, 0)]
        self._stats["tokens_generated"] += int(counts.sum())
        ended_on_device = alive & (counts > 0) & ~was_active[max(ran - 1, 0)]
        self._finish(busy[alive & (counts > 0)], finished)
        assert not s.active[busy[ended_on_device]].any(), "host and device stop rules differ"
