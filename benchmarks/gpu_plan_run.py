"""The deployment plan read on this machine's GPU, then a colocated run it laid out: its peak memory
against the plan's figure.

    python -m benchmarks.gpu_plan_run [--arch qwen3-0.6b] [--steps 3] [--dry-run]

Prints two JSON lines. `plan`: what `python -m april_jax.train --plan --json` says for a
Qwen3-shaped model (random weights of the `--arch` preset, bf16 compute) on this host's devices,
trained on the synthetic reverse task with the embedded JAX engine on the same GPU. `colocated_run`:
that run's few steps (trainer and JAX engine on the one GPU, under the plan's allocator settings,
which `train.run` applies before JAX's backend starts), the device's `peak_bytes_in_use` from
`memory_stats()` beside the plan's trainer peak plus the engine's KV cache, and their ratio
(`measured_over_planned`: under 1 means the plan's margin held). On a CPU (`--dry-run`: the tiny
model) the memory figures are null: XLA:CPU keeps no such statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def config(arch: str, steps: int, workdir: str, max_response_len: int):
    from april_jax.config import default_config

    c = default_config()
    c.workdir = workdir
    if arch == "tiny":
        c.model.arch = "tiny"
    else:
        c.model.arch = arch
        c.model.compute_dtype = "bfloat16"
        c.model.remat = "full"
    c.data.task = "reverse"
    c.rollout.engine = "jax"
    c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt = 8, 4
    c.rollout.over_sampling_batch_size = 16
    c.rollout.max_response_len = max_response_len
    c.rollout.max_num_seqs = 64
    c.train.total_steps = steps
    c.train.micro_batch_size = 8
    c.train.compile_cache_dir = ""
    c.checkpoint.every = 1000
    c.log.tensorboard = c.log.progress = False
    return c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-response-len", type=int, default=512)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on whatever JAX has (CPU here)")
    args = parser.parse_args()
    arch = "tiny" if args.dry_run else args.arch
    from april_jax.training import devices as devices_lib
    from april_jax.training.plan import make_plan

    with tempfile.TemporaryDirectory() as workdir:
        c = config(arch, args.steps, workdir, 32 if args.dry_run else args.max_response_len)
        plan = make_plan(c, devices_lib.local_devices())
        planned = plan.trainer["peak_bytes_per_device"] + plan.rollout["jax_engine"]["kv_cache_bytes_per_device"]
        print(json.dumps({"benchmark": "gpu_plan_run", "part": "plan", "arch": arch, **plan.to_dict()}), flush=True)
        if not plan.fits:
            print(json.dumps({"benchmark": "gpu_plan_run", "part": "colocated_run", "error": plan.error_line()}))
            sys.exit(1)
        from april_jax import train

        t0 = time.perf_counter()
        last = train.run(c)  # applies the plan's allocator settings before JAX's backend starts
        seconds = time.perf_counter() - t0
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        print(
            json.dumps(
                {
                    "benchmark": "gpu_plan_run",
                    "part": "colocated_run",
                    "arch": arch,
                    "steps": args.steps,
                    "seconds": round(seconds, 1),
                    "device": jax.devices()[0].device_kind,
                    "planned_peak_bytes": int(planned),
                    "measured_peak_bytes": peak,
                    "bytes_limit": stats.get("bytes_limit"),
                    "measured_over_planned": round(peak / planned, 3) if peak else None,
                    "last_loss": last.get("train/loss"),
                    "env": plan.trainer["env"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
