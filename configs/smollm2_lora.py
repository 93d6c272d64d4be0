"""configs/smollm2_rl.py's task with LoRA: SmolLM2-135M-Instruct frozen, rank-16 adapters trained.

    python -m april_jax.train --config configs/smollm2_lora.py

The same model, word problems, reward, rollout, batch (8 prompts x 8 samples, micro-batch 8),
steps and evaluation as configs/smollm2_rl.py (read from it, so the two cannot drift apart); only
what LoRA changes differs: adapters of rank 16, alpha 32 on all seven projections of every layer
(about 4.9M trainable parameters against 135M), and a learning rate 10x full fine-tuning's, the
usual LoRA starting point (the update runs through the small B matrix that starts at 0).

Not tuned: rank, alpha and lr were NOT chosen by a measured sweep, and the accuracy runs of
configs/smollm2_rl.py's docstring (greedy eval accuracy +0.15 within 20 min, 3 seeds, APRIL and
sync: `python -m benchmarks.april_vs_sync --config configs/smollm2_lora.py --seeds 0,1,2`) have
not been run with it. What it is measured to buy is the train step (docs/performance.md, "LoRA
train step"); the rollout engine still gets the merged weights each step.
"""

import importlib.util
from pathlib import Path


def _rl_config():
    spec = importlib.util.spec_from_file_location("smollm2_rl", Path(__file__).with_name("smollm2_rl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _rl_config()
    c.workdir = "runs/smollm2_lora"
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    c.model.lora_targets = "all"
    c.optimizer.lr = 1e-4  # 10x configs/smollm2_rl.py's 1e-5: a rule of thumb, not a sweep
    return c
