"""Loading a real checkpoint through `safetensors.safe_open` (what models/safetensors_io.py uses
now) vs a hand-written numpy-memmap reader, back to back in one process.

    python -m benchmarks.safetensors_load [--reps 3]

Prints JSON: seconds per full `hf.from_pretrained` of SmolLM2-135M-Instruct (fp32 params) with
each reader, best of --reps, alternating A/B so machine noise hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


class MemmapDir:
    """The hand-written reader: header parsed by hand, tensors as views of one np.memmap per file."""

    def __init__(self, path):
        import struct
        from pathlib import Path

        import ml_dtypes

        dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
        self._entries = {}
        file = Path(path) / "model.safetensors"
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        data = np.memmap(file, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                self._entries[name] = (
                    data,
                    np.dtype(dtypes[info["dtype"]]),
                    tuple(info["shape"]),
                    8 + n + a,
                    8 + n + b,
                )

    def __contains__(self, name):
        return name in self._entries

    def keys(self):
        return self._entries.keys()

    def shape(self, name):
        return self._entries[name][2]

    def read(self, name, index=None):
        data, dtype, shape, a, b = self._entries[name]
        array = data[a:b].view(dtype).reshape(shape)
        return np.array(array if index is None else array[index], copy=True)  # a copy, as the library's reader makes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from april_jax import assets
    from april_jax.models import hf, safetensors_io

    path = assets.smollm2_135m_instruct()
    readers = {"safe_open": safetensors_io.SafetensorsDir, "memmap": MemmapDir}
    times = {k: [] for k in readers}
    for _ in range(args.reps):
        for name, reader in readers.items():
            hf.SafetensorsDir = reader
            t = time.perf_counter()
            model = hf.from_pretrained(path)
            times[name].append(time.perf_counter() - t)
            del model
    hf.SafetensorsDir = readers["safe_open"]
    print(
        json.dumps(
            {
                "checkpoint": "SmolLM2-135M-Instruct (fp32)",
                "load_avg_1min": os.getloadavg()[0],
                **{f"{k}_best_s": round(min(v), 3) for k, v in times.items()},
                **{f"{k}_all_s": [round(x, 3) for x in v] for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
