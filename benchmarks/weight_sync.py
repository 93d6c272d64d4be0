"""Seconds per trainer -> engine weight sync for each transport that runs without a GPU, against a
raw memory copy of the same bytes (measured in the same run).

    python -m benchmarks.weight_sync [--repeats 5]

A sync = JAX params -> HF-named tensors (DLPack, zero-copy) -> safetensors bytes at the
destination (write) -> torch tensors on the receiving side (safetensors.torch.load_file).
Transports: `shm` (a new file in /dev/shm per sync), `file` (the temp dir's disk), and
`shm_shared_buffer` (a fixed-layout file in /dev/shm overwritten in place: the shared-memory
transport). `write_only` is the trainer's side; `sync` adds the receiver's load into torch.
The CUDA-IPC transport is not measured here (no GPU, no vLLM).

`--lora-rank R` (16 by default, 0: skip) adds what a sync costs under LoRA. As the product does it
now (`lora.merged_sync`): the engine gets the base with the adapters merged in, so a sync is the
merge (W + scale (A B)^T on every target) and then the same bytes as full fine-tuning through the
shared buffer. What an adapters-only sync would move (`lora.adapters_only`): the A and B tensors,
timed as a safetensors file in /dev/shm written and read back. That is only an estimate of the
transport: vLLM's LoRA adapter path (engines loading adapters instead of merged weights) is not
built, and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import safetensors.torch

from april_jax.models import lora, qwen3
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
    parser.add_argument("--lora-rank", type=int, default=16, help="also time a LoRA run's sync (0: skip)")
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
    if args.lora_rank and os.path.isdir("/dev/shm"):
        out["lora"] = lora_sync(args.lora_rank, nbytes, args.repeats)
    print(json.dumps(out))


def lora_sync(rank: int, full_bytes: int, repeats: int) -> dict:
    """A LoRA run's sync: merged (what the engine gets now) and adapters-only (bytes, a file's time)."""
    import jax
    import safetensors.numpy

    from april_jax.rl.losses import LossConfig
    from april_jax.rl.train_step import OptimizerConfig, Trainer

    trainer = Trainer(qwen3.init_model(CONFIG_40M, seed=0), LossConfig(), OptimizerConfig(), lora=lora.LoRAConfig(rank))
    merged = weights.named_torch(trainer.nnx_state())
    merged_bytes = sum(t.numel() * t.element_size() for t in merged.values())
    merge_s = best_of(lambda: jax.block_until_ready(trainer.nnx_state()), repeats)
    buffer = weights.SharedSafetensors(merged, f"/dev/shm/april_jax_lora_merged_{os.getpid()}.safetensors")

    def merged_sync():
        buffer.write(weights.named_torch(trainer.nnx_state()))
        return safetensors.torch.load_file(buffer.path)

    merged_sync()
    merged_s = best_of(merged_sync, repeats)
    os.remove(buffer.path)

    adapters = lora.peft_tensors(trainer.params)  # the tensors a PEFT / vLLM adapter holds
    adapter_bytes = sum(a.nbytes for a in adapters.values())
    path = f"/dev/shm/april_jax_lora_adapters_{os.getpid()}.safetensors"

    def adapters_sync():
        safetensors.numpy.save_file(lora.peft_tensors(trainer.params), path)
        return safetensors.numpy.load_file(path)

    adapters_sync()
    adapters_s = best_of(adapters_sync, repeats)
    os.remove(path)
    return {
        "rank": rank,
        "targets": "all",
        "merged_sync": {
            "what": "the product today: the base with the adapters merged, the same tensors as full fine-tuning",
            "bytes": merged_bytes,
            "bytes_ratio_to_full": round(merged_bytes / full_bytes, 4),
            "merge_s": round(merge_s, 4),
            "sync_s": round(merged_s, 4),
        },
        "adapters_only": {
            "what": "A and B only, as a safetensors file in /dev/shm written and read back",
            "bytes": adapter_bytes,
            "bytes_ratio_to_full": round(adapter_bytes / full_bytes, 4),
            "sync_s": round(adapters_s, 4),
            "vllm_adapter_sync": "not built: engines get merged weights; no vLLM LoRA adapter path yet",
        },
    }


if __name__ == "__main__":
    main()
