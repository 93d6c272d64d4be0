"""Parking for the KV cache rows of aborted requests, so that a resumed request skips its re-prefill.

APRIL aborts every unfinished request at the end of a rollout step and resumes it next step as a
new request whose prompt is the old prompt + the tokens generated so far. Without parking, the
engine re-prefills all of it; on CPU a prefill token costs about as much as a decode token, so the
re-prefills of long partial responses eat a fifth or more of the engine's time (docs/performance.md).

With parking, `abort` copies each running row (KV of prompt + partial, all but the last token)
into a side cache, keyed by the exact token ids; a later request whose prompt is exactly those ids
gets the row copied back and goes straight to decoding. The trade: the parked KV was computed by
the weights of the time it was generated, as with in-flight weight updates (the engine already
keeps in-flight KV across `update_weights`). Every token still records the version that sampled
it and its logprob is the probability it was sampled with, so the trainer's importance ratios
against behaviour logprobs stay exact; but the continuation is conditioned through older-weight
KV, which a re-prefill (vLLM after `reset_prefix_cache`) would not be. Off by default.

Capacity is a number of rows; when full, the least recently parked row is reused.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from april_jax.models.qwen3 import KVCache, Qwen3Config


def _copy_rows(dst: KVCache, dst_rows_N, src: KVCache, src_rows_N) -> KVCache:
    """dst with rows dst_rows_N replaced by src rows src_rows_N (out-of-range dst rows dropped)."""
    picked = KVCache(*jax.tree.map(lambda x: x[src_rows_N], (src.k, src.v, src.lengths_B)))
    return dst.put_rows(dst_rows_N, picked)


_copy_rows_jit = jax.jit(_copy_rows, donate_argnums=0)


def _padded(pairs: list[tuple[int, int]], out_of_range: int) -> tuple[np.ndarray, np.ndarray]:
    """(dst, src) index arrays padded to a power of two; padding writes to `out_of_range` (dropped)."""
    n = 1 << (len(pairs) - 1).bit_length()
    dst, src = np.full(n, out_of_range, np.int32), np.zeros(n, np.int32)
    for r, (d, s) in enumerate(pairs):
        dst[r], src[r] = d, s
    return dst, src


class KVParking:
    def __init__(self, cfg: Qwen3Config, capacity: int, max_len: int, dtype, shardings: KVCache | None = None):
        """`shardings`: the engine cache's (its shape is this cache's), so parked rows stay on their devices."""
        self.cfg, self.capacity, self.max_len, self.dtype = cfg, capacity, max_len, dtype
        self.shardings = shardings
        self._cache: KVCache | None = None  # allocated at the first park
        self._rows: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self._free = list(range(capacity))
        self.parked = self.reused = self.evicted = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, token_ids) -> bool:
        return tuple(token_ids) in self._rows

    def park(self, cache: KVCache, running: list[tuple[int, tuple[int, ...]]]) -> None:
        """Copy rows of `cache` (slot, full token ids of that row) into the parking cache."""
        pairs = []
        for slot, key in running:
            if key in self._rows or len(key) < 2:
                continue
            if not self._free:
                _, row = self._rows.popitem(last=False)
                self._free.append(row)
                self.evicted += 1
            row = self._free.pop()
            self._rows[key] = row
            pairs.append((row, slot))
        if not pairs:
            return
        if self._cache is None:
            zeros = lambda: KVCache.zeros(self.cfg, self.capacity, self.max_len, self.dtype)
            self._cache = zeros() if self.shardings is None else jax.jit(zeros, out_shardings=self.shardings)()
        dst, src = _padded(pairs, self.capacity)
        self._cache = _copy_rows_jit(self._cache, dst, cache, src)
        self.parked += len(pairs)

    def restore(self, cache: KVCache, wanted: list[tuple[int, tuple[int, ...]]]) -> KVCache:
        """Copy parked rows back into slots: `wanted` is (slot, token ids), every key parked."""
        pairs = []
        for slot, key in wanted:
            row = self._rows.pop(key)
            self._free.append(row)
            pairs.append((slot, row))
        self.reused += len(pairs)
        dst, src = _padded(pairs, cache.lengths_B.shape[0])
        return _copy_rows_jit(cache, dst, self._cache, src)

    def offload(self) -> None:
        """Parked rows to host memory (the engine sleeps while the trainer steps)."""
        if self._cache is not None:
            host = jax.tree.map(np.array, self._cache)  # a copy: a CPU device_get may alias the buffer
            for x in jax.tree.leaves(self._cache):
                x.delete()
            self._cache = host

    def reload(self) -> None:
        if self._cache is not None:
            self._cache = jax.device_put(self._cache, self.shardings)

    def clear(self) -> None:
        self._rows.clear()
        self._free = list(range(self.capacity))
        self._cache = None
