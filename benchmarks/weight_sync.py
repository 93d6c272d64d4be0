"""Seconds per trainer -> engine weight sync for each transport that runs without a GPU, against a
raw memory copy of the same bytes (measured in the same run).

    python -m benchmarks.weight_sync [--repeats 5]

A sync = JAX params -> HF-named tensors (DLPack, zero-copy) -> safetensors bytes at the
destination (write) -> torch tensors on the receiving side (safetensors.torch.load_file).
Transports: `shm` (a new file in /dev/shm per sync), `file` (the temp dir's disk), and
`shm_shared_buffer` (a fixed-layout file in /dev/shm overwritten in place: the shared-memory
transport). `write_only` is the trainer's side; `sync` adds the receiver's load into torch.
The CUDA-IPC transport is not measured here (no GPU, no vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import safetensors.torch

from april_jax.models import qwen3
from april_jax.rollout.vllm import weights
from benchmarks.common import CONFIG_40M


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def time_file_transport(model, named, path: str, repeats: int) -> tuple[float, float]:
    """(best seconds of a sync: write + the receiver's load, best seconds of the write alone)."""

    def sync():
        weights.write_safetensors(weights.named_torch(model), path)
        return safetensors.torch.load_file(path)

    loaded = sync()
    assert all(np.array_equal(loaded[k].numpy(), v.numpy()) for k, v in named.items())
    write_s = best_of(lambda: weights.write_safetensors(weights.named_torch(model), path), repeats)
    total_s = best_of(sync, repeats)
    os.remove(path)
    return total_s, write_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = qwen3.init_model(CONFIG_40M, seed=0)
    named = weights.named_torch(model)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    src = np.concatenate([t.numpy().ravel() for t in named.values()])
    dst = np.empty_like(src)
    memcpy_s = best_of(lambda: np.copyto(dst, src), args.repeats)
    out = {
        "benchmark": "weight_sync",
        "params_m": round(CONFIG_40M.num_params / 1e6, 1),
        "bytes": nbytes,
        "raw_memcpy_s": round(memcpy_s, 4),
        "transports": {},
    }
    dirs = {"shm": "/dev/shm", "file": tempfile.gettempdir()}
    for name, base in dirs.items():
        if not os.path.isdir(base):
            continue
        path = os.path.join(base, f"april_jax_sync_{os.getpid()}.safetensors")
        total_s, write_s = time_file_transport(model, named, path, args.repeats)
        out["transports"][name] = {
            "sync_s": round(total_s, 4),
            "write_only_s": round(write_s, 4),
            "ratio_to_memcpy": round(total_s / memcpy_s, 2),
            "write_ratio_to_memcpy": round(write_s / memcpy_s, 2),
        }
    if os.path.isdir("/dev/shm"):
        buffer = weights.SharedSafetensors(named, f"/dev/shm/april_jax_shared_{os.getpid()}.safetensors")

        def shared_sync():
            buffer.write(weights.named_torch(model))
            return safetensors.torch.load_file(buffer.path)

        loaded = shared_sync()
        assert all(np.array_equal(loaded[k].numpy(), v.numpy()) for k, v in named.items())
        write_s = best_of(lambda: buffer.write(weights.named_torch(model)), args.repeats)
        total_s = best_of(shared_sync, args.repeats)
        os.remove(buffer.path)
        out["transports"]["shm_shared_buffer"] = {
            "sync_s": round(total_s, 4),
            "write_only_s": round(write_s, 4),
            "ratio_to_memcpy": round(total_s / memcpy_s, 2),
            "write_ratio_to_memcpy": round(write_s / memcpy_s, 2),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
