"""The held KV rows of a `JaxEngine` as JSON, so that a checkpoint written on a stop signal keeps them.

With `hold_aborted_kv` and a KV cache kept through the train step, the engine ends a step holding
the KV of the responses APRIL aborted, and resumes them next step without a re-prefill. A run
resumed from a checkpoint that lacked them would re-prefill those responses; a prefill's logits
differ from the incremental decode's in the last bits, so the resumed run would sample other
tokens than the uninterrupted one. Saving the rows (their slots, tokens, lengths and the cache
positions they use, bit for bit) and putting them back where they were makes the two runs equal.

The arrays travel as base64 of their raw bytes with dtype and shape: exact for every dtype
(bfloat16 included) and never unpickled.
"""

from __future__ import annotations

import base64

import jax.numpy as jnp
import numpy as np

from april_jax.models.qwen3 import KVCache

# A stop signal's checkpoint leaves out held rows larger than this (the resume then re-prefills
# them: equal in distribution, not bit for bit); a grace period is no time to write gigabytes.
MAX_SAVED_BYTES = 256 << 20


def _encode(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x)
    return {"dtype": str(x.dtype), "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode("ascii")}


def _decode(d: dict) -> np.ndarray:
    raw = base64.b64decode(d["data"].encode("ascii"), validate=True)
    return np.frombuffer(raw, jnp.dtype(d["dtype"])).reshape(d["shape"])


def snapshot(cache: KVCache, held: list[tuple[int, tuple[int, ...]]]) -> dict | None:
    """The rows `held` ((slot, token ids), oldest first) of `cache`, copied to host memory (the
    cache moves on; `to_json` encodes the copy only if a checkpoint needs it); None when nothing is
    held or the rows exceed MAX_SAVED_BYTES."""
    if not held or cache is None:
        return None
    slots = np.array([slot for slot, _ in held], np.int32)
    lengths = np.asarray(cache.lengths_B)[slots]
    used = max(int(lengths.max()), 1)  # positions past a row's length are masked: not needed
    per_position = sum(k.shape[1] * k.shape[2] * k.dtype.itemsize for k in cache.k) * 2
    if len(slots) * used * per_position > MAX_SAVED_BYTES:
        return None
    k = [np.array(layer[slots, :, :, :used]) for layer in cache.k]
    v = [np.array(layer[slots, :, :used, :]) for layer in cache.v]
    return {
        "slots": slots.tolist(),
        "tokens": [list(tokens) for _, tokens in held],
        "lengths": lengths.tolist(),
        "k": k,
        "v": v,
    }


def to_json(snap: dict) -> dict:
    """A `snapshot` as JSON: the arrays as base64 of their bytes with dtype and shape."""
    return dict(snap, k=[_encode(x) for x in snap["k"]], v=[_encode(x) for x in snap["v"]])


def check(state: dict, cache: KVCache) -> str | None:
    """Why `state` does not fit `cache` (another model or engine size), or None."""
    slots = state.get("slots")
    if not isinstance(slots, list) or not all(isinstance(s, int) for s in slots):
        return "held KV: 'slots' is not a list of ints"
    if len(state.get("k", ())) != len(cache.k) or len(state.get("v", ())) != len(cache.v):
        return "held KV: another number of layers"
    rows = cache.lengths_B.shape[0]
    if any(not 0 <= s < rows for s in slots) or len(set(slots)) != len(slots):
        return f"held KV: slots {slots} do not fit an engine of {rows} slots"
    if not (len(state.get("tokens", ())) == len(state.get("lengths", ())) == len(slots)):
        return "held KV: slots, tokens and lengths differ in number"
    for name, layers, axis in (("k", cache.k, 3), ("v", cache.v, 2)):  # axis: the positions
        for d, layer in zip(state[name], layers):
            shape, want = list(d.get("shape", [])), list(layer.shape)
            fits = len(shape) == 4 and 0 < shape[axis] <= want[axis]
            if fits:
                want[0], want[axis] = len(slots), shape[axis]
            if not fits or shape != want or d.get("dtype") != str(layer.dtype):
                return f"held KV: {name} rows {shape} {d.get('dtype')} do not fit a cache of {list(layer.shape)} {layer.dtype}"
    return None


def restore(cache: KVCache, state: dict) -> tuple[KVCache, list[tuple[int, tuple[int, ...]]]]:
    """`cache` with the saved rows back in their slots, and the held (slot, token ids), oldest first."""
    slots = np.array(state["slots"], np.int32)
    saved = KVCache(
        tuple(jnp.asarray(_decode(d)) for d in state["k"]),
        tuple(jnp.asarray(_decode(d)) for d in state["v"]),
        jnp.asarray(np.array(state["lengths"], np.int32)),
    )
    return cache.put_rows(slots, saved), [
        (int(s), tuple(int(t) for t in tokens)) for s, tokens in zip(slots, state["tokens"])
    ]
