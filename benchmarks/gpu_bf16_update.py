"""Does a bf16 train step still move the weights? One AdamW step at the recipes' lr vs fp32.

    python -m benchmarks.gpu_bf16_update [--lr 1e-6] [--model small] [--dry-run]

With `model.dtype = "bfloat16"` the parameters themselves (and so AdamW's update) are bf16, which
is why configs/qwen3_4b.py and qwen3_8b.py keep fp32 master weights with bf16 compute. AdamW's first step moves each weight by about lr; a bf16 weight
w only changes when the step exceeds half its spacing (|w| * 2^-8), so at lr 1e-6 and |w| ~ 0.02
(or the norms' 1.0) nearly every update rounds away. This prints, per precision, the fraction of
parameters one step changed and the cosine of its update with the fp32 one (same init, batch):
`fp32` (reference), `mixed` (fp32 params, bf16 compute), `bf16` (bf16 params and compute).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from april_jax.models import qwen3
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from benchmarks.gpu_common import device_info, emit, model_config
from benchmarks.gpu_train_mfu import random_batch

SMALL = qwen3.Qwen3Config(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--model", default="small", help="'small' (the test size), 'tiny' or a preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: the same code in seconds on CPU")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.batch, args.seq = "tiny", 2, 32
    base = SMALL if args.model == "small" else model_config(args.model)
    batch = random_batch(base, args.batch, args.seq)
    row = {"benchmark": "gpu_bf16_update", **device_info(), "model": args.model, "lr": args.lr}
    deltas = {}
    for name, param_dtype, dtype in (
        ("fp32", "float32", "float32"),
        ("mixed", "float32", "bfloat16"),
        ("bf16", "bfloat16", "bfloat16"),
    ):
        cfg = base.replace(param_dtype=param_dtype, dtype=dtype)
        # pi_old = the behaviour logprobs: one compiled program per precision (the update is the point)
        trainer = Trainer(qwen3.init_model(cfg, seed=0), LossConfig(pi_old="bypass"), OptimizerConfig(lr=args.lr))
        before = flat(trainer.params)
        metrics = trainer.step(batch, 0)
        deltas[name] = flat(trainer.params) - before
        row[f"{name}_skipped"] = int(metrics["train/skipped"])
    ref = deltas["fp32"]
    for name, d in deltas.items():
        row[f"{name}_changed_frac"] = round(float(np.mean(d != 0)), 4)
        row[f"{name}_update_cosine_vs_fp32"] = round(
            float(d @ ref / (np.linalg.norm(d) * np.linalg.norm(ref) + 1e-30)), 4
        )
    emit(row)


if __name__ == "__main__":
    main()
