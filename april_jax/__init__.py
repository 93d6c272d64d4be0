"""april_jax: RL post-training for LLMs in JAX/Flax with Active Partial Rollouts (APRIL)."""

__version__ = "0.1.0"
