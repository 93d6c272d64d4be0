"""Minimal safetensors reader/writer on numpy memory maps.

Why not `safetensors.numpy`: numpy has no bfloat16, and real Qwen3 checkpoints are bf16. Here
tensors are memory-mapped with `ml_dtypes` dtypes, so a device shard reads only its own slice of
the file (a 8B checkpoint never needs a full host copy per device).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing or malformed; the message names it."""


class SafetensorsDir:
    """All tensors of `model.safetensors` or of the files listed in `model.safetensors.index.json`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._entries: dict[str, tuple[np.memmap, np.dtype, tuple[int, ...], int, int]] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index but missing")
            self._read_header(file)

    def _read_header(self, file: Path):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        data = np.memmap(file, dtype=np.uint8, mode="r")
        base = 8 + header_len
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(f"{file}: tensor {tensor!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            self._entries[tensor] = (data, _DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + end)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self):
        return self._entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def read(self, name: str, index=None) -> np.ndarray:
        """The tensor (a memory-mapped view; only the pages `index` touches are read)."""
        data, dtype, shape, start, end = self._entries[name]
        array = data[start:end].view(dtype).reshape(shape)
        return array if index is None else array[index]


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
    """Write `tensors` as one safetensors file, atomically (temp file + rename)."""
    file = Path(file)
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    prefix, _ = layout(arrays)
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(prefix)
        for array in arrays.values():
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
