"""Load time and forward tokens/s of a ~40M-parameter Qwen3 (fp32) on this machine's devices.

python -m benchmarks.forward [--batch 8] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from april_jax.models import hf, qwen3
from benchmarks.common import CONFIG_40M, timed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    cfg = CONFIG_40M
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(qwen3.init_model(cfg, seed=0), tmp)
        t = time.perf_counter()
        model = hf.from_pretrained(tmp)
        jax.block_until_ready(nnx.state(model))
        load_s = time.perf_counter() - t

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    ids = jax.random.randint(jax.random.key(0), (args.batch, args.seq), 0, cfg.vocab_size, jnp.int32)
    t = time.perf_counter()
    jax.block_until_ready(forward(state, ids))
    compile_s = time.perf_counter() - t
    step_s, _ = timed(forward, state, ids)
    print(
        json.dumps(
            {
                "benchmark": "forward",
                "backend": jax.default_backend(),
                "devices": jax.device_count(),
                "params_m": round(cfg.num_params / 1e6, 1),
                "batch": args.batch,
                "seq": args.seq,
                "load_s": round(load_s, 3),
                "compile_s": round(compile_s, 2),
                "forward_s": round(step_s, 4),
                "forward_tokens_per_s": round(args.batch * args.seq / step_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
