"""safetensors files through the `safetensors` library, with errors that name the file.

Reading: `safe_open(..., framework="numpy")` memory-maps each file and `get_slice(name)[index]`
reads only the slice a device shard needs (bf16 comes back as an `ml_dtypes.bfloat16` array), so
an 8B checkpoint never needs a full host copy per device. Writing: the library's `save_file`
(it writes from the arrays' own buffers, no copy) into a temporary name, fsync, then rename.

`layout` stays ours: the shared-memory weight transport (`april_jax.rollout.vllm.weights.SharedSafetensors`)
lays a file out once and overwrites each tensor in place every sync, which the library's
whole-file writers cannot do.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from april_jax.runtime.errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class SafetensorsDir:
    """All tensors of `model.safetensors` or of the files listed in `model.safetensors.index.json`."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(
                    f"{index}: not a safetensors index ({type(e).__name__}: {_first_line(e)})"
                ) from None
        elif single.exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._files: dict[str, object] = {}  # tensor name -> the open file holding it
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index but missing")
            try:
                handle = safe_open(str(file), framework="numpy")
                for tensor in handle.keys():
                    info = handle.get_slice(tensor)
                    if info.get_dtype() not in _DTYPES:
                        raise CheckpointError(f"{file}: tensor {tensor!r} has unsupported dtype {info.get_dtype()}")
                    self._files[tensor], self._shapes[tensor] = handle, tuple(info.get_shape())
            except CheckpointError:
                raise
            except Exception as e:  # SafetensorError: truncated file, bad header, not safetensors at all
                raise CheckpointError(f"{file}: not a readable safetensors file ({_first_line(e)})") from None

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def keys(self):
        return self._files.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor, or only its `index` slice (a tuple of slices, as sharding callbacks pass)."""
        part = self._files[name].get_slice(name)
        return part[...] if index is None or index is Ellipsis else part[index]


def layout(tensors: dict[str, np.ndarray]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(length-prefixed header bytes, {name: (start, end) byte offsets from the file start})."""
    header, offset, spans = {"__metadata__": {"format": "pt"}}, 0, {}
    for name, array in tensors.items():
        dtype = np.dtype(array.dtype)
        if dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be written to safetensors")
        nbytes = int(np.prod(array.shape)) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (offset, offset + nbytes)
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    prefix = struct.pack("<Q", len(header_bytes)) + header_bytes
    return prefix, {k: (a + len(prefix), b + len(prefix)) for k, (a, b) in spans.items()}


def save_file(tensors: dict[str, np.ndarray], file: str | os.PathLike) -> None:
    """Write `tensors` as one safetensors file, atomically (temp file + fsync + rename)."""
    from safetensors.numpy import save_file as library_save_file

    file = Path(file)
    arrays = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)  # the library writes from the raw buffer: it must be contiguous
        if a.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors")
        arrays[name] = a
    tmp = file.with_name(file.name + ".tmp")
    library_save_file(arrays, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, file)
