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

`--lora-rank R` trains rank-R LoRA adapters (`model.lora_rank`, all seven projections, alpha 32) on
the frozen base instead of every weight (0: full fine-tuning); `optimizer_state_bytes` is the
AdamW state's bytes either way. `--compare-lora R` builds both on the same model shape and batch
and times their steps interleaved (full, LoRA, full, ...: load from other processes on the
machine hits both alike), then prints both and the LoRA / full ratios of step time and optimiser
state. `--model smollm2-135m` is SmolLM2-135M's shape (random weights: the time does not depend
on them); with `--rl-batch` the batch is configs/smollm2_rl.py's: 8 prompts x 8 samples,
micro-batch 8, 64 prompt + 64 response tokens.

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

from april_jax.models import lora as lora_lib, qwen3
from april_jax.rl import train_step
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from benchmarks.common import CONFIG_40M

# SmolLM2-135M(-Instruct)'s config.json (the `smollm2-135m-instruct` asset): a llama, tied embeddings.
SMOLLM2_135M = qwen3.Qwen3Config.from_hf_config(
    {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    }
)
MODELS = {"40m": CONFIG_40M, "smollm2-135m": SMOLLM2_135M}
# What LoRA is meant to buy on this step (checked by --compare-lora, reported, never asserted).
GOAL_STEP_RATIO, GOAL_OPT_STATE_RATIO = 0.7, 0.05


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def make_trainer(cfg, lora_rank: int, micro: int, seed: int) -> Trainer:
    lora = lora_lib.LoRAConfig(lora_rank, 32.0, seed=seed) if lora_rank else None
    model = qwen3.init_model(cfg, seed=seed)  # one per trainer: a full step donates its params
    return Trainer(model, LossConfig(), OptimizerConfig(lr=1e-6), micro_batch_size=micro, lora=lora)


def time_steps(trainers: dict, batch: dict, epochs: int, steps: int) -> dict:
    """{name: (compile seconds, per-epoch step seconds of each step, last metrics)}: one step each
    to compile, then `steps` rounds of one step of each trainer in turn."""
    out = {}
    for name, trainer in trainers.items():
        t = time.perf_counter()
        trainer.update(batch, 0, epochs)
        out[name] = [time.perf_counter() - t, [], None]
    for _ in range(steps):
        for name, trainer in trainers.items():
            t = time.perf_counter()
            out[name][2] = trainer.update(batch, 0, epochs)
            out[name][1].append((time.perf_counter() - t) / epochs)
    return out


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
    parser.add_argument("--model", default="40m", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument(
        "--rl-batch", action="store_true", help="configs/smollm2_rl.py's batch: --batch 64 --seq 128 --micro 8"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the model's init, the adapters' and the batch's")
    parser.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs per rollout batch (train.num_iterations)")
    parser.add_argument(
        "--zero-adv-frac", type=float, default=0.0, help="share of rows with advantage 0 (skipped micro-batches)"
    )
    parser.add_argument("--vocab", type=int, default=None, help="the model's own unless given")
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=train_step.LOGPROB_CHUNK,
        help="sequence positions whose logits are made at once (0: all)",
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: full fine-tuning)")
    parser.add_argument(
        "--compare-lora", type=int, default=0, metavar="R", help="time full fine-tuning and rank-R LoRA side by side"
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="compile the step, print its temporary memory, run nothing"
    )
    args = parser.parse_args()
    if args.rl_batch:
        args.batch, args.seq, args.micro = 64, 128, 8
    if not 0 <= args.zero_adv_frac <= 1:
        parser.error(f"--zero-adv-frac {args.zero_adv_frac}: a share in [0, 1]")
    if args.seq < 66:  # 64 prompt tokens, then at least one response token
        parser.error(f"--seq {args.seq}: at least 66 (64 prompt tokens + a response)")
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: at least 1")
    if (args.vocab is not None and args.vocab < 64) or args.logprob_chunk < 0:
        parser.error("--vocab: at least 64; --logprob-chunk: at least 0")
    if args.lora_rank < 0 or args.compare_lora < 0 or (args.lora_rank and args.compare_lora):
        parser.error("--lora-rank / --compare-lora: a rank >= 0, one of the two")
    cfg = MODELS[args.model].replace(remat=args.remat)
    if args.vocab is not None:
        cfg = cfg.replace(vocab_size=args.vocab)
    B, S = args.batch, args.seq
    rng = np.random.default_rng(args.seed)
    batch = {
        "input_ids": rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32),
        "loss_mask": np.concatenate([np.zeros((B, 64)), np.ones((B, S - 65))], 1).astype(np.float32),
        "behaviour_logp": np.full((B, S - 1), -10.0, np.float32),
        "versions": np.zeros((B, S - 1), np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }
    batch["advantages"][: round(args.zero_adv_frac * B)] = 0.0  # the step sorts them to the end
    micro = min(args.micro, B)
    head = {"backend": jax.default_backend(), "devices": jax.device_count(), "model": args.model}
    head.update(params_m=round(cfg.num_params / 1e6, 1), batch=B, seq=S, micro_batch=micro, seed=args.seed)
    if args.compare_lora:
        compare(args, cfg, batch, micro, head)
        return
    trainer = make_trainer(cfg, args.lora_rank, micro, args.seed)
    if args.memory_only:
        out = {"benchmark": "train_step_memory", "backend": jax.default_backend(), "vocab": cfg.vocab_size}
        out.update(batch=B, seq=S, micro_batch=micro, remat=args.remat, logprob_chunk=args.logprob_chunk)
        out.update(lora_rank=args.lora_rank)
        out["temp_bytes"] = step_temp_bytes(trainer, batch, args.logprob_chunk)
        out["temp_bytes_unchunked"] = step_temp_bytes(trainer, batch, 0)
        print(json.dumps(out))
        return
    train_step.LOGPROB_CHUNK = args.logprob_chunk
    (compile_s, times, metrics) = time_steps({"run": trainer}, batch, args.epochs, args.steps)["run"]
    computed = metrics["train/computed_rows_frac"]
    step_s = min(times)
    out = {"benchmark": "train_step", **head, "remat": args.remat, "epochs": args.epochs}
    out.update(zero_adv_frac=args.zero_adv_frac, computed_rows_frac=round(computed, 3), lora_rank=args.lora_rank)
    out.update(
        trainable_params=int(sum(x.size for x in jax.tree.leaves(trainer.params))),
        optimizer_state_bytes=tree_bytes(trainer.opt_state),
        compile_s=round(compile_s, 2),
        step_s=round(step_s, 3),
        tokens_per_s=round(B * (S - 1) / step_s, 1),
    )
    if not args.lora_rank:  # LoRA skips the base's weight gradients: 6N per token is not its work
        peak = matmul_peak_flops()
        T = S - 1
        L, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
        forward = 2 * cfg.num_params * B * T + 2 * L * T * T * H * D * B
        flops = 3 * forward * computed + (forward / args.epochs if args.epochs > 1 else 0)
        out.update(
            achieved_gflops=round(flops / step_s / 1e9, 1),
            matmul_peak_gflops=round(peak / 1e9, 1),
            fraction_of_peak=round(flops / step_s / peak, 3),
        )
    print(json.dumps(out))


def compare(args, cfg, batch: dict, micro: int, head: dict) -> None:
    """Full fine-tuning and rank-`args.compare_lora` LoRA on the same shape and batch, interleaved."""
    train_step.LOGPROB_CHUNK = args.logprob_chunk
    trainers = {
        "full": make_trainer(cfg, 0, micro, args.seed),
        "lora": make_trainer(cfg, args.compare_lora, micro, args.seed),
    }
    timed = time_steps(trainers, batch, args.epochs, args.steps)
    out = {"benchmark": "train_step_lora_vs_full", **head, "lora_rank": args.compare_lora, "lora_alpha": 32.0}
    out.update(lora_targets="all", epochs=args.epochs, steps=args.steps)
    for name, trainer in trainers.items():
        compile_s, times, _ = timed[name]
        out[name] = {
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(trainer.params))),
            "optimizer_state_bytes": tree_bytes(trainer.opt_state),
            "compile_s": round(compile_s, 2),
            "step_s": round(min(times), 3),
            "step_s_each": [round(t, 3) for t in times],
        }
    step_ratio = out["lora"]["step_s"] / out["full"]["step_s"]
    state_ratio = out["lora"]["optimizer_state_bytes"] / out["full"]["optimizer_state_bytes"]
    out["step_s_ratio"] = round(step_ratio, 3)
    out["optimizer_state_ratio"] = round(state_ratio, 4)
    out["goals"] = {
        f"step_s_ratio<={GOAL_STEP_RATIO}": step_ratio <= GOAL_STEP_RATIO,
        f"optimizer_state_ratio<={GOAL_OPT_STATE_RATIO}": state_ratio <= GOAL_OPT_STATE_RATIO,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
