"""The embedded engine's device programs: prefill, extend and decode, each over the rows it serves.

- `prefill`: N distinct prompts from position 0, their KV copied into the M slots that start from
  them (a group's members share one prefill row).
- `extend`: M slots that already hold a prefix (a group's prompt, just prefilled once) take their
  own suffix (a resumed member's partial response) in one batched forward over a compact copy of
  those rows, then sample their first token.
- `decode`: up to `steps_per_call` steps for the busy slots only, compacted into a batch bucket
  (`rows_B`, padded with an out-of-range slot) and cut to a cache length bucket
  (`num_positions`): attention reads no idle slot and no position past the bucket; only the new
  positions are written back into the engine's cache. The loop stops early once every row has
  ended (at its stop token or length limit, the rules the host applies).
- `copy_rows`: slots that start from a prompt another slot already holds take a copy of that row.

Shapes are static per (rows bucket, length bucket, mode), so each program compiles once per bucket;
`TRACES` counts the traces (= compiles) per program, which the tests read.
"""

from __future__ import annotations

import collections
import functools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from april_jax.models.qwen3 import KVCache
from april_jax.rollout import sampling

TRACES: collections.Counter = collections.Counter()


def prefill(
    graphdef,
    state,
    cache: KVCache,
    next_token_S,
    slots_M,
    source_M,
    tokens_NT,
    lengths_N,
    temperature_M,
    top_p_M,
    top_k_M,
    seeds_M,
    *,
    mode,
):
    """Prefill N distinct prompts once and start M requests from them: request m takes prompt
    `source_M[m]`'s KV rows into slot `slots_M[m]` and samples its first token with its own key.
    Padding requests carry slot index = #slots and are dropped. The first tokens also go into
    `next_token_S`, the decode step's input, so no host round trip sits between the two calls."""
    TRACES["prefill"] += 1
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


def extend(
    graphdef,
    state,
    cache: KVCache,
    next_token_S,
    rows_M,
    tokens_MT,
    lengths_M,
    temperature_M,
    top_p_M,
    top_k_M,
    seeds_M,
    *,
    mode,
    num_positions,
):
    """Rows `rows_M` hold a prefix; append `lengths_M` tokens of `tokens_MT` (right-padded) to each
    and sample the first new token after them. Padding rows carry row index = #slots."""
    TRACES["extend"] += 1
    model = nnx.merge(graphdef, state)
    small = cache.take_rows(rows_M, num_positions)
    start_M = small.lengths_B
    logits_MTV, small = model.forward(tokens_MT, cache=small, num_new_B=lengths_M)
    last_MV = jnp.take_along_axis(logits_MTV, jnp.maximum(lengths_M - 1, 0)[:, None, None], axis=1)[:, 0]
    keys = sampling.request_keys(seeds_M, jnp.zeros(rows_M.shape, jnp.int32))
    tokens_M, logprobs_M = sampling.sample(last_MV, keys, temperature_M, top_p_M, top_k_M, mode=mode)
    cache = cache.put_new_positions(rows_M, small, start_M, tokens_MT.shape[1])
    return cache, tokens_M, logprobs_M, next_token_S.at[rows_M].set(tokens_M, mode="drop")


def decode(
    graphdef,
    state,
    cache: KVCache,
    next_token_S,
    rows_B,
    active_B,
    temperature_B,
    top_p_B,
    top_k_B,
    seeds_B,
    steps_B,
    limits_B,
    stop_ids_BP,
    max_steps,
    *,
    mode,
    num_positions,
    steps_per_call,
    in_place=False,
):
    """Up to `max_steps` (<= steps_per_call) decode steps for rows `rows_B` of the cache. A row
    stops (and its cache stops growing) after a stop token or when its token count reaches
    `limits_B`. Outputs are [steps_per_call, B] tokens, logprobs and whether the row was active
    at that step (all False for steps not run)."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, state)
    # in_place: every slot, the whole cache (rows_B = all slots): no gather, no write-back copy
    small = cache if in_place else cache.take_rows(rows_B, num_positions)
    start_B = small.lengths_B
    tokens_B = next_token_S[jnp.minimum(rows_B, next_token_S.shape[0] - 1)]
    K, B = steps_per_call, rows_B.shape[0]
    outputs = (jnp.zeros((K, B), jnp.int32), jnp.zeros((K, B), jnp.float32), jnp.zeros((K, B), bool))

    def more(carry):
        k, _, _, active_B, _, _ = carry
        return (k < max_steps) & jnp.any(active_B)

    def one_step(carry):
        k, small, tokens_B, active_B, steps_B, (tokens_KB, logprobs_KB, active_KB) = carry
        logits_B1V, small = model.forward(tokens_B[:, None], cache=small, num_new_B=active_B.astype(jnp.int32))
        keys = sampling.request_keys(seeds_B, steps_B)
        new_B, logprobs_B = sampling.sample(logits_B1V[:, 0], keys, temperature_B, top_p_B, top_k_B, mode=mode)
        steps_B = steps_B + active_B.astype(jnp.int32)
        done_B = jnp.any(new_B[:, None] == stop_ids_BP, axis=-1) | (steps_B >= limits_B)
        outputs = (tokens_KB.at[k].set(new_B), logprobs_KB.at[k].set(logprobs_B), active_KB.at[k].set(active_B))
        return k + 1, small, jnp.where(active_B, new_B, tokens_B), active_B & ~done_B, steps_B, outputs

    _, small, *_, (tokens_KB, logprobs_KB, active_KB) = jax.lax.while_loop(
        more, one_step, (jnp.int32(0), small, tokens_B, active_B, steps_B, outputs)
    )
    cache = small if in_place else cache.put_new_positions(rows_B, small, start_B, K)
    return cache, tokens_KB, logprobs_KB, active_KB


def copy_rows(cache: KVCache, src_N, dst_N, lengths_N) -> KVCache:
    """Copy whole rows `src_N` into rows `dst_N` and set their valid lengths to `lengths_N`:
    a request starts from a prompt another slot already holds. Padding pairs carry dst = #slots
    and are dropped."""
    TRACES["copy_rows"] += 1
    src_N = jnp.minimum(src_N, cache.lengths_B.shape[0] - 1)
    return KVCache(
        tuple(k.at[dst_N].set(k[src_N], mode="drop") for k in cache.k),
        tuple(v.at[dst_N].set(v[src_N], mode="drop") for v in cache.v),
        cache.lengths_B.at[dst_N].set(lengths_N, mode="drop"),
    )


class Programs(NamedTuple):
    prefill: callable
    extend: callable
    decode: callable
    copy_rows: callable


@functools.lru_cache(maxsize=16)
def compiled(graphdef) -> Programs:
    """The programs jitted with `graphdef` closed over (hashing a graphdef per call costs ms) and
    the cache donated."""
    jit = lambda f, *static: jax.jit(
        partial(f, graphdef), static_argnames=("mode", *static), donate_argnames=("cache",)
    )
    return Programs(
        jit(prefill),
        jit(extend, "num_positions"),
        jit(decode, "num_positions", "steps_per_call", "in_place"),
        jax.jit(copy_rows, donate_argnames=("cache",)),
    )


def pow2_at_least(n: int, cap: int | None = None) -> int:
    b = 1 << max(n - 1, 0).bit_length()
    return b if cap is None else min(b, cap)


def length_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_len`, then `max_len`."""
    buckets, b = [], smallest
    while b < max_len:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_len,)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)
