"""Trainer -> engine weight transport: HF-named tensors from JAX params, zero-copy where possible.

- `named_numpy(params)`: {hf_name: numpy view} of an nnx.State / model, gathered to host.
  On CPU, `np.asarray` of an unsharded jax array is a view (no copy).
- `named_torch(params)`: {hf_name: torch.Tensor} via DLPack, zero-copy for unsharded arrays
  on the same device (CPU or one GPU). Sharded arrays are gathered first (DLPack cannot export
  them). An in-place torch write would change the "immutable" JAX array: treat them read-only.
- `write_safetensors(named, path)`: the file transport (a new file per sync).
- `SharedSafetensors(example, path)`: the shared-memory transport on one host. A safetensors
  file in /dev/shm is laid out once; each sync copies every tensor into its memory-mapped slot
  (one memcpy per byte, no page allocation, no fsync), and the engine maps the same file.
- `transport_name` / `make_transport_dir` / `reclaim_transport_leftovers`: what the transport
  leaves in /dev/shm is named after its owner (boot, pid, start time), so a later start removes
  what a SIGKILLed trainer left: otherwise a full copy of the weights stays in RAM until reboot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

from april_jax.models.hf import hf_name
from april_jax.models.safetensors_io import layout, save_file

TRANSPORT_PREFIX = "april_jax_weights_"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
    except OSError:
        return "noboot"


def transport_name(suffix: str = "") -> str:
    """`april_jax_weights_<boot>_<pid>-<start>_<suffix>`: a name this process owns. The boot id
    tells a host's own entries from those of other hosts sharing the folder (a pid means nothing
    there)."""
    from april_jax.rollout.vllm.proctree import owner_tag

    return f"{TRANSPORT_PREFIX}{_boot_id()}_{owner_tag()}_{suffix}"


def make_transport_dir(base) -> Path:
    """A fresh folder (mode 0700) under `base` named after this process."""
    return Path(tempfile.mkdtemp(prefix=transport_name(), dir=base))


def reclaim_transport_leftovers(base) -> list[Path]:
    """Remove the transport folders and files under `base` whose owner (on this host, this boot,
    this user) is dead. Entries of live owners, of other hosts, of other users, or named otherwise
    are left alone. Returns what was removed."""
    from april_jax.rollout.vllm.proctree import tag_alive

    removed = []
    try:
        entries = list(Path(base).iterdir())
    except OSError:
        return removed
    boot = _boot_id()
    for entry in entries:
        if not entry.name.startswith(TRANSPORT_PREFIX):
            continue
        parts = entry.name[len(TRANSPORT_PREFIX) :].split("_")
        if len(parts) < 3 or parts[0] != boot or tag_alive(parts[1]):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if info.st_uid != os.getuid() or entry.is_symlink():
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _flat(params) -> dict:
    state = nnx.state(params, nnx.Param) if isinstance(params, nnx.Module) else params
    return {hf_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def _unsharded(array):
    """The array itself if it lives on one device, else a gathered host copy (DLPack cannot
    export a sharded array)."""
    import jax

    if isinstance(array, jax.Array) and len(array.sharding.device_set) > 1:
        return jax.device_get(array)
    return array


def named_numpy(params) -> dict[str, np.ndarray]:
    return {name: np.asarray(_unsharded(a)) for name, a in _flat(params).items()}


def named_torch(params) -> dict:
    import torch

    out = {}
    for name, a in _flat(params).items():
        a = _unsharded(a)
        out[name] = torch.from_dlpack(a) if not isinstance(a, np.ndarray) else torch.from_numpy(a)
    return out


def host_numpy(tensor) -> np.ndarray:
    """A host numpy array of a torch tensor or array: GPU tensors are copied to the host, and
    bf16 goes through an int16 view (torch's `.numpy()` refuses bf16; numpy has ml_dtypes')."""
    if not hasattr(tensor, "numpy"):
        return np.asarray(tensor)
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def write_safetensors(named: dict, path) -> None:
    save_file({k: host_numpy(v) for k, v in named.items()}, path)


class SharedSafetensors:
    """A fixed-layout safetensors file (in /dev/shm) that each sync overwrites in place."""

    def __init__(self, example: dict, path):
        arrays = {k: host_numpy(v) for k, v in example.items()}
        prefix, spans = layout(arrays)
        size = max(end for _, end in spans.values())
        with open(path, "wb") as f:
            f.write(prefix)
            f.truncate(size)
        self.path = str(path)
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        self._views = {k: self._map[a:b].view(arrays[k].dtype).reshape(arrays[k].shape) for k, (a, b) in spans.items()}

    def write(self, named: dict) -> None:
        if named.keys() != self._views.keys():
            raise KeyError(f"{self.path}: tensor names differ from the buffer's layout")
        for k, v in named.items():
            np.copyto(self._views[k], host_numpy(v))
        # no msync: /dev/shm pages are the shared memory itself

    def close(self) -> None:
        del self._views, self._map


class CudaIpcBucket:
    """CUDA transport for a vLLM server on the same GPU: one flat torch CUDA buffer holds every
    tensor, its CUDA IPC handle is made once, and each sync is one device-side copy per tensor.
    The worker maps the same memory (`rollout.vllm.worker_ext.april_update_from_cuda_ipc`).

    Why a torch-allocated buffer and not the JAX arrays themselves: CUDA IPC handles come from
    torch's caching allocator (`storage._share_cuda_`); memory that torch only borrowed through
    DLPack has no such base allocation. The copy runs at device bandwidth.

    UNTESTED: written for GPU hosts and guarded, but no run on a GPU with vLLM has proved it yet
    (the machines it was written on have no GPU). The shared-memory transport is the tested one.
    """

    ALIGN = 256

    def __init__(self, example: dict):
        import torch

        not_cuda = sorted(k for k, v in example.items() if not (isinstance(v, torch.Tensor) and v.is_cuda))
        if not_cuda:
            raise ValueError(
                f"weight_transport 'cuda_ipc' needs the trainer's parameters on a CUDA device; "
                f"{not_cuda[0]} (and {len(not_cuda) - 1} more) are not: use 'shm' on this host"
            )
        self.meta, offset = [], 0
        for name, t in example.items():
            nbytes = t.numel() * t.element_size()
            self.meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // self.ALIGN) * self.ALIGN
        device = next(iter(example.values())).device
        self.buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        self._views = {
            name: self.buffer[off : off + n].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, off, n in self.meta
        }

    def write(self, named: dict) -> None:
        import torch

        if named.keys() != self._views.keys():
            raise KeyError("cuda_ipc buffer: tensor names differ from the buffer's layout")
        for name, t in named.items():
            self._views[name].copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.buffer.device)

    def payload(self) -> str:
        """The handle and layout as JSON (bytes base64-encoded) for a collective_rpc call; the
        worker rebuilds the tensor from these fields alone, no pickle on either side."""
        import base64
        import json

        from torch.multiprocessing.reductions import reduce_tensor

        (
            _,
            (
                _cls,
                size,
                stride,
                offset,
                storage_cls,
                _dtype,
                _device,
                handle,
                storage_bytes,
                storage_offset,
                _grad,
                ref_handle,
                ref_offset,
                event_handle,
                event_sync,
            ),
        ) = reduce_tensor(self.buffer)

        def b64(raw):
            return None if raw is None else base64.b64encode(raw).decode()

        return json.dumps(
            {
                "layout": [list(m) for m in self.meta],
                "size": list(size),
                "stride": list(stride),
                "offset": int(offset),
                "storage_cls": storage_cls.__name__,
                "handle": b64(handle),
                "storage_size_bytes": int(storage_bytes),
                "storage_offset_bytes": int(storage_offset),
                "ref_counter_handle": b64(ref_handle),
                "ref_counter_offset": int(ref_offset),
                "event_handle": b64(event_handle),
                "event_sync_required": bool(event_sync),
            }
        )
