"""Train-step throughput of a ~40M-parameter Qwen3 and its fraction of a measured matmul peak.

    python -m benchmarks.train_step [--batch 8] [--seq 512] [--micro 8] [--epochs 1] [--zero-adv-frac 0]
        [--vocab 32000] [--logprob-chunk N] [--memory-only]

The peak is measured in the same run with a large jnp.dot (fp32), so machine noise affects both.
One rollout batch is `Trainer.update` with `--epochs` PPO epochs, as train.py runs it; `step_s` is
its time over the epochs. FLOPs per optimiser step: forward+backward (6N per token), N = parameters
including the lm_head, plus causal attention: the score and value products over the T^2 / 2
query-key pairs at or below the diagonal (6 L T^2 H D per sequence for fwd+bwd), the work a causal
kernel has to do; with 2+ epochs, plus pi_old's forward once per batch (2N per token and
2 L T^2 H D, shared by the epochs; one epoch takes pi_old from its own forward). With --remat the
recomputed forward is not counted: the fraction is of model FLOPs, as MFU is. `--zero-adv-frac`
gives that share of the rows advantage 0 (GRPO groups of equal rewards), whose micro-batches the
step skips; the FLOPs count the computed rows only, `step_s` is the whole step.

`--memory-only` compiles the step without running it and prints the temporary memory XLA's buffer
assignment gives it (`temp_bytes`), beside the same step with the [B, T, V] logits made at once
(`temp_bytes_unchunked`, `--logprob-chunk 0`): what long responses at a large vocabulary cost.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.models import qwen3
from april_jax.rl import train_step
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from benchmarks.common import CONFIG_40M


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_temp_bytes(trainer: Trainer, batch: dict, logprob_chunk: int) -> int:
    """Temporary bytes of `trainer`'s compiled step on `batch` (one epoch; compiled, never run) with
    the logits made `logprob_chunk` positions at a time (0: all at once)."""
    prepared = trainer.prepare(batch, fix_pi_old=False)
    n_micro = trainer._micro(prepared["input_ids"].shape[0])
    previous, train_step.LOGPROB_CHUNK = train_step.LOGPROB_CHUNK, logprob_chunk
    try:  # a jit of its own: the chunk size is read when the step is traced
        step = jax.jit(partial(trainer._step_impl, n_micro), donate_argnums=(0, 1))
        compiled = step.lower(trainer.params, trainer.opt_state, trainer.base, prepared, jnp.int32(0)).compile()
    finally:
        train_step.LOGPROB_CHUNK = previous
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs per rollout batch (train.num_iterations)")
    parser.add_argument(
        "--zero-adv-frac", type=float, default=0.0, help="share of rows with advantage 0 (skipped micro-batches)"
    )
    parser.add_argument("--vocab", type=int, default=CONFIG_40M.vocab_size)
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=train_step.LOGPROB_CHUNK,
        help="sequence positions whose logits are made at once (0: all)",
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="compile the step, print its temporary memory, run nothing"
    )
    args = parser.parse_args()
    if not 0 <= args.zero_adv_frac <= 1:
        parser.error(f"--zero-adv-frac {args.zero_adv_frac}: a share in [0, 1]")
    if args.seq < 66:  # 64 prompt tokens, then at least one response token
        parser.error(f"--seq {args.seq}: at least 66 (64 prompt tokens + a response)")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: at least 1")
    if args.vocab < 64 or args.logprob_chunk < 0:
        parser.error("--vocab: at least 64; --logprob-chunk: at least 0")
    cfg = CONFIG_40M.replace(remat=args.remat, vocab_size=args.vocab)
    B, S = args.batch, args.seq
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32),
        "loss_mask": np.concatenate([np.zeros((B, 64)), np.ones((B, S - 65))], 1).astype(np.float32),
        "behaviour_logp": np.full((B, S - 1), -10.0, np.float32),
        "versions": np.zeros((B, S - 1), np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }
    batch["advantages"][: round(args.zero_adv_frac * B)] = 0.0  # the step sorts them to the end
    micro = min(args.micro, B)
    trainer = Trainer(qwen3.init_model(cfg), LossConfig(), OptimizerConfig(lr=1e-6), micro_batch_size=micro)
    if args.memory_only:
        out = {"benchmark": "train_step_memory", "backend": jax.default_backend(), "vocab": args.vocab}
        out.update(batch=B, seq=S, micro_batch=micro, remat=args.remat, logprob_chunk=args.logprob_chunk)
        out["temp_bytes"] = step_temp_bytes(trainer, batch, args.logprob_chunk)
        out["temp_bytes_unchunked"] = step_temp_bytes(trainer, batch, 0)
        print(json.dumps(out))
        return
    train_step.LOGPROB_CHUNK = args.logprob_chunk
    t = time.perf_counter()
    trainer.update(batch, 0, args.epochs)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        metrics = trainer.update(batch, 0, args.epochs)
        times.append((time.perf_counter() - t) / args.epochs)
    computed = metrics["train/computed_rows_frac"]
    step_s = min(times)
    peak = matmul_peak_flops()
    T = S - 1
    L, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    forward = 2 * cfg.num_params * B * T + 2 * L * T * T * H * D * B
    flops = 3 * forward * computed + (forward / args.epochs if args.epochs > 1 else 0)
    print(
        json.dumps(
            {
                "benchmark": "train_step",
                "backend": jax.default_backend(),
                "devices": jax.device_count(),
                "params_m": round(cfg.num_params / 1e6, 1),
                "batch": B,
                "seq": S,
                "micro_batch": micro,
                "remat": args.remat,
                "epochs": args.epochs,
                "zero_adv_frac": args.zero_adv_frac,
                "computed_rows_frac": round(computed, 3),
                "compile_s": round(compile_s, 2),
                "step_s": round(step_s, 3),
                "tokens_per_s": round(B * T / step_s, 1),
                "achieved_gflops": round(flops / step_s / 1e9, 1),
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "fraction_of_peak": round(flops / step_s / peak, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
