"""Trainer -> engine weight transfer on a GPU vs a raw copy of the same bytes.

    python -m benchmarks.gpu_weight_transfer [--models qwen3-0.6b,qwen3-1.7b] [--param-dtype float32] [--dry-run]

Per model (random init, the trainer's parameter dtype):
- `export_s`: `weights.named_torch` (JAX -> HF-named torch tensors by DLPack; zero-copy: the
  tensors share the JAX buffers, `zero_copy` says whether every pointer matched);
- `raw_copy_s`: one device-to-device copy of all the bytes (torch; host memcpy without CUDA);
- `cuda_ipc_write_s`: `CudaIpcBucket.write` (a copy per tensor into the shared buffer, synced),
  and `cuda_ipc_receive_s`: a torch process (benchmarks/cuda_ipc_receiver.py, the vLLM worker
  extension's code) mapping the buffer and copying every tensor out, timed inside it;
- `shm_write_s`: `SharedSafetensors.write`, the default transport (host memory); an error is
  recorded as it is, not worked around.
One JSON line per model.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import numpy as np
import torch

from april_jax.models import qwen3
from april_jax.rollout.vllm import weights
from benchmarks.gpu_common import device_info, emit, model_config


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def jax_pointer(array) -> int:
    """Device address of a single-device jax array (the attribute moved between JAX versions)."""
    if hasattr(array, "unsafe_buffer_pointer"):
        return array.unsafe_buffer_pointer()
    if hasattr(array, "__cuda_array_interface__"):
        return array.__cuda_array_interface__["data"][0]
    return array.addressable_data(0).unsafe_buffer_pointer()


def named_jax(model) -> dict:
    from flax import nnx

    from april_jax.models.hf import hf_name

    return {hf_name(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def measure(name: str, args) -> dict:
    cfg = model_config(name).replace(param_dtype=args.param_dtype, dtype="bfloat16")
    model = qwen3.init_model(cfg, seed=0)
    cuda = torch.cuda.is_available() and jax.default_backend() == "gpu"
    row = {"model": name, "param_dtype": args.param_dtype, "cuda": cuda}
    export_s = best_of(lambda: weights.named_torch(model), args.repeats)
    named = weights.named_torch(model)
    by_name = named_jax(model)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    row.update(
        {
            "tensors": len(named),
            "bytes": nbytes,
            "export_s": round(export_s, 6),
            "zero_copy": all(named[k].data_ptr() == jax_pointer(by_name[k]) for k in named),
            "export_device": str(next(iter(named.values())).device),
        }
    )
    if cuda:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        raw_s = best_of(lambda: (dst.copy_(src), torch.cuda.synchronize()), args.repeats)
        del src, dst
        torch.cuda.empty_cache()
    else:
        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        raw_s = best_of(lambda: np.copyto(dst, src), args.repeats)
        del src, dst
    row["raw_copy_s"] = round(raw_s, 6)
    row["raw_copy_gb_per_s"] = round(nbytes / raw_s / 1e9, 1)
    if cuda:
        from benchmarks.cuda_ipc_receiver import ReceiverProcess

        bucket = weights.CudaIpcBucket(named)
        write_s = best_of(lambda: bucket.write(weights.named_torch(model)), args.repeats)
        receiver = ReceiverProcess(mode="copy")
        try:
            answers = [receiver.send(bucket.payload()) for _ in range(args.repeats + 1)]
        finally:
            receiver.close()
        receive_s = min(a["seconds"] for a in answers[1:])  # the first maps the handle and allocates
        row.update(
            {
                "cuda_ipc_write_s": round(write_s, 6),
                "cuda_ipc_write_over_raw": round(write_s / raw_s, 2),
                "cuda_ipc_receive_s": round(receive_s, 6),
                "cuda_ipc_first_receive_s": round(answers[0]["seconds"], 4),
                "cuda_ipc_receive_over_raw": round(receive_s / raw_s, 2),
                "cuda_ipc_tensors_received": answers[-1]["tensors"],
            }
        )
        del bucket
        torch.cuda.empty_cache()  # the next model's buffers and the receiver need the room
    else:
        row["cuda_ipc"] = "skipped: needs CUDA (torch.cuda and a JAX GPU backend)"
    if os.path.isdir("/dev/shm"):
        path = f"/dev/shm/april_jax_gpu_bench_{os.getpid()}.safetensors"
        try:
            buffer = weights.SharedSafetensors(named, path)
            shm_s = best_of(lambda: buffer.write(weights.named_torch(model)), args.repeats)
            row.update({"shm_write_s": round(shm_s, 6), "shm_write_over_raw": round(shm_s / raw_s, 2)})
        except Exception as e:  # a GPU path of the default transport: record, do not work around
            row["shm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            if os.path.exists(path):
                os.remove(path)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: the same code in seconds on CPU")
    args = parser.parse_args()
    if args.dry_run:
        args.models, args.repeats = "tiny", 2
    info = device_info()
    for name in args.models.split(","):
        row = {"benchmark": "gpu_weight_transfer", **info}
        try:
            row.update(measure(name, args))
        except Exception as e:
            row.update({"model": name, "error": f"{type(e).__name__}: {str(e)[:800]}"})
        emit(row)
        gc.collect()


if __name__ == "__main__":
    main()
