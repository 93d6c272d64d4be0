"""vLLM worker extension (`--worker-extension-cls april_jax.rollout.vllm.worker_ext.WeightUpdateExt`).

Runs inside the vLLM worker process, so it imports only torch, safetensors and the standard
library. Weights arrive as safetensors files (a JSON header of names, dtypes, shapes and offsets,
then raw bytes) or, on a GPU, as a CUDA IPC handle described in JSON: nothing from a request is
unpickled. A file is read only when it resolves (symlinks followed) inside the run's transport
folder, given to the server at launch in $APRIL_JAX_TRANSPORT_DIR.

Loading goes through the model runner's reload path: plain `model.load_weights` fails on vLLM's
CPU backend (linear weights are prepacked) and leaves a half-updated model.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

TRANSPORT_DIR_ENV = "APRIL_JAX_TRANSPORT_DIR"
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def inside_transport_dir(path: str) -> Path:
    """`path` resolved, or PermissionError when it is not a file inside the transport folder."""
    root = os.environ.get(TRANSPORT_DIR_ENV)
    if not root:
        raise PermissionError(
            f"weight update refused: the server was started without ${TRANSPORT_DIR_ENV}, so no file may be read"
        )
    root_dir = Path(root).resolve()
    file = Path(path).resolve()
    if not file.is_relative_to(root_dir) or file == root_dir:
        raise PermissionError(f"weight update refused: {path!r} is outside the transport folder {root_dir}")
    if not file.is_file():
        raise FileNotFoundError(f"weight update: {path!r} is not a file")
    return file


def _b64(text):
    return None if text is None else base64.b64decode(text)


class WeightUpdateExt:
    def april_update_from_file(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` (e.g. the /dev/shm buffer)."""
        import safetensors.torch

        named = list(safetensors.torch.load_file(inside_transport_dir(path)).items())
        self.model_runner.reload_weights(weights_iterator=iter(named))
        return len(named)

    def april_update_from_cuda_ipc(self, payload: str) -> int:
        """Map the trainer's CUDA buffer (`april_jax.rollout.vllm.weights.CudaIpcBucket.payload`: JSON) and load
        from it. UNTESTED until a GPU run proves it."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        spec = json.loads(payload)  # a ValueError for anything that is not JSON (a pickle, say)
        storage_cls = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}[
            spec["storage_cls"]
        ]
        buffer = rebuild_cuda_tensor(
            torch.Tensor,
            tuple(int(n) for n in spec["size"]),
            tuple(int(n) for n in spec["stride"]),
            int(spec["offset"]),
            storage_cls,
            torch.uint8,
            self.device.index,  # same physical GPU, but CUDA_VISIBLE_DEVICES may renumber it
            _b64(spec["handle"]),
            int(spec["storage_size_bytes"]),
            int(spec["storage_offset_bytes"]),
            False,
            _b64(spec["ref_counter_handle"]),
            int(spec["ref_counter_offset"]),
            _b64(spec["event_handle"]),
            bool(spec["event_sync_required"]),
        )
        named = []
        for name, dtype, shape, off, n in spec["layout"]:
            if dtype not in WEIGHT_DTYPES:
                raise ValueError(
                    f"cuda_ipc layout: tensor {name!r} has dtype {dtype!r}; expected one of {WEIGHT_DTYPES}"
                )
            named.append(
                (
                    str(name),
                    buffer[int(off) : int(off) + int(n)].view(getattr(torch, dtype)).view(tuple(int(s) for s in shape)),
                )
            )
        self.model_runner.reload_weights(weights_iterator=iter(named))
        torch.cuda.synchronize()
        return len(named)
