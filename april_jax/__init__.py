"""april_jax: RL post-training for LLMs in JAX/Flax with Active Partial Rollouts (APRIL).

Subpackages: config (the keys, their checks, loading a run's config), data (prompts, tokenizers,
tasks' data), models (Qwen3, Hugging Face checkpoints, sharding), rollout (APRIL, the engines),
rl (advantages, losses, the train step, rewards), training (what a run builds: task, model,
engine, evaluation, checkpoint meta, metrics), runtime (process plumbing: several processes,
signals, checkpoints, the workdir lock, compile cache and clock, error kinds), cli (entry points).

Modules at the root, each for a reason:
- train.py: the training recipe, read top to bottom, and `python -m april_jax.train`, the
  documented command (it runs cli/train.py's main).
- assets.py: `asset:NAME` weights, tokenizers and data sets shipped in registry packages, used
  alike by the config, data/, models/ tests and the demo.
"""

__version__ = "0.1.0"
