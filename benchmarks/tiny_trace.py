"""Every device call of a tiny run's rollout steps 8-11, blocked on and timed (one JSON line each).

    python benchmarks/tiny_trace.py --config configs/tiny.py --config.train.total_steps=12 \
        --config.eval.every=0 --config.workdir=/tmp/tiny_trace [--config.x=value ...]

Wraps `JaxEngine._device` (prefill, extend, KV copies) and `_decode_step`, and APRIL's
`collect` (one "step" line). Blocking on each call serialises what the engine overlaps, so a
step's total is a little above its unblocked time; the per-call figures are what each costs.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from april_jax.cli import train  # noqa: E402
from april_jax.rollout import april, jax_engine  # noqa: E402

FIRST_STEP = 8
step = {"n": 0}


def emit(call: str, t: float, **fields) -> None:
    if step["n"] >= FIRST_STEP:
        print(json.dumps({"step": step["n"], "call": call, **fields, "ms": round((time.perf_counter() - t) * 1e3, 2)}),
              flush=True)


def main() -> None:
    original_collect = april.April.collect

    def collect(self, engine, version):
        step["n"] += 1
        t = time.perf_counter()
        out = original_collect(self, engine, version)
        emit("step", t)
        return out

    april.April.collect = collect
    shapes = lambda args: [list(getattr(a, "shape", ())) for a in args[4:8]]
    original_device = jax_engine.JaxEngine._device

    def device(self, program, *args, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(original_device(self, program, *args, **kw))
        emit(getattr(program, "__name__", type(program).__name__), t, shapes=shapes(args))
        return out

    jax_engine.JaxEngine._device = device
    original_decode = jax_engine.JaxEngine._decode_step

    def decode(self, busy, finished):
        t = time.perf_counter()
        original_decode(self, busy, finished)
        emit("decode", t, rows=len(busy))

    jax_engine.JaxEngine._decode_step = decode
    train.main(["tiny_trace", *sys.argv[1:]])


if __name__ == "__main__":
    main()
