"""Train-step MFU of Qwen3-0.6B- and 1.7B-shaped models against a measured bf16 matmul peak.

    python -m benchmarks.gpu_train_mfu [--models qwen3-0.6b,qwen3-1.7b] [--remats none,full]
                                       [--batch 16] [--seq 2048] [--micro 4] [--steps 3] [--dry-run]

Random init, fp32 master parameters, bf16 compute (`attention_impl=auto`: cuDNN flash attention on
a GPU), the real `Trainer.step` (pi_old recompute + micro-batched fwd/bwd + AdamW + the metrics'
host read). One JSON line per (model, remat) as it finishes, then none: the peak is in each line.

MFU = model FLOPs per step / step seconds / peak. Model FLOPs per step, T = seq - 1 positions:
8 N B T (the pi_old forward, 2N a token, and the update's forward + backward, 6N a token; N =
parameters in matmuls: the lm_head counts, an untied embedding lookup does not) plus causal
attention, 8 L T^2 H D B (score and value products over the T^2 / 2 pairs at or below the
diagonal: 6 L T^2 H D for fwd+bwd, 2 for the extra forward). Remat's recomputed forward is not
counted (MFU counts model FLOPs, not hardware FLOPs). The peak: an 8192^3 bf16 matmul, same run.
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np

from april_jax.models import qwen3
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from benchmarks.gpu_common import bf16_matmul_peak_flops, device_info, device_peak_bytes, emit, model_config

GOAL_MFU = 0.45  # the goal on an H200


def matmul_params(cfg: qwen3.Qwen3Config) -> int:
    return cfg.num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def step_flops(cfg: qwen3.Qwen3Config, batch: int, seq: int) -> float:
    T = seq - 1
    attention = 8 * cfg.num_hidden_layers * T * T * cfg.num_attention_heads * cfg.head_dim * batch
    return 8 * matmul_params(cfg) * batch * T + attention


def random_batch(cfg: qwen3.Qwen3Config, batch: int, seq: int) -> dict:
    """Random tokens; the first quarter of each row is prompt (no loss), the rest response."""
    rng = np.random.default_rng(0)
    prompt = seq // 4
    mask = np.zeros((batch, seq - 1), np.float32)
    mask[:, prompt - 1 :] = 1
    return {
        "input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
        "loss_mask": mask,
        "behaviour_logp": np.full((batch, seq - 1), -10.0, np.float32),
        "versions": np.zeros((batch, seq - 1), np.int32),
        "advantages": rng.normal(size=batch).astype(np.float32),
    }


def measure(name: str, remat: str, args, peak: float) -> dict:
    cfg = model_config(name).replace(
        param_dtype=args.param_dtype, dtype="bfloat16", remat=remat, attention_impl=args.attention_impl
    )
    batch = random_batch(cfg, args.batch, args.seq)
    trainer = Trainer(
        qwen3.init_model(cfg, seed=0), LossConfig(), OptimizerConfig(lr=1e-6), micro_batch_size=args.micro
    )
    t = time.perf_counter()
    first = trainer.step(batch, 0)  # compiles
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        metrics = trainer.step(batch, 0)
        times.append(time.perf_counter() - t)
    step_s = min(times)
    mfu = step_flops(cfg, args.batch, args.seq) / step_s / peak
    return {
        "model": name,
        "remat": remat,
        "params_m": round(cfg.num_params / 1e6, 1),
        "param_dtype": args.param_dtype,
        "compute_dtype": "bfloat16",
        "attention_impl": args.attention_impl,
        "batch": args.batch,
        "seq": args.seq,
        "micro_batch": args.micro,
        "compile_plus_first_step_s": round(compile_s, 2),
        "step_s": round(step_s, 4),
        "step_s_all": [round(x, 4) for x in times],
        "tokens_per_s": round(args.batch * (args.seq - 1) / step_s, 1),
        "model_tflops_per_step": round(step_flops(cfg, args.batch, args.seq) / 1e12, 3),
        "achieved_tflops": round(step_flops(cfg, args.batch, args.seq) / step_s / 1e12, 2),
        "mfu": round(mfu, 4),
        "loss_finite": bool(np.isfinite(metrics["train/loss"])),
        "skipped_steps": int(metrics["train/skipped_steps"]),
        "first_step_skipped": int(first["train/skipped"]),
        "peak_device_bytes": device_peak_bytes(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument("--remats", default="none,full")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-impl", default="auto", choices=qwen3.ATTENTION_IMPLS)
    parser.add_argument("--peak-n", type=int, default=8192, help="matmul size of the measured peak")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: the same code in seconds on CPU")
    args = parser.parse_args()
    if args.dry_run:
        args.models, args.batch, args.seq, args.micro, args.steps, args.peak_n = "tiny", 2, 64, 1, 1, 256
    info = device_info()
    peak = bf16_matmul_peak_flops(args.peak_n)
    for name in args.models.split(","):
        for remat in args.remats.split(","):
            row = {
                "benchmark": "gpu_train_mfu",
                **info,
                "matmul_peak_tflops": round(peak / 1e12, 2),
                "goal_mfu": GOAL_MFU,
            }
            try:
                row.update(measure(name, remat, args, peak))
            except Exception as e:  # e.g. out of memory: record it, go on with the next configuration
                row.update({"model": name, "remat": remat, "error": f"{type(e).__name__}: {str(e)[:800]}"})
            emit(row)
            gc.collect()
            jax.clear_caches()


if __name__ == "__main__":
    main()
