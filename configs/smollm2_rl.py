"""A real pretrained model learns on CPU: SmolLM2-135M-Instruct on small arithmetic word problems.

    python -m april_jax.train --config configs/smollm2_rl.py

"Mia has 11 pencils and gets 2 more. How many pencils does Mia have now?" (sums, differences,
small products and two-step problems; `april_jax/data/word_problems.py`, generated once with a
fixed seed). The reward pays the response's last number when it is the answer. At step 0 the model
answers 32 of the 100 held-out problems greedily: it often states the right number, then keeps
talking and ends on another one, or rambles to the budget, so response lengths run from a few tokens
to the budget (a long tail, which APRIL cuts). GRPO teaches it to end on its answer. Greedy accuracy
on the 100 held-out problems (no arithmetic combination of them is trained on) is evaluated before
step 0 and every `eval.every` steps (`eval/accuracy` in metrics.jsonl; `python -m april_jax.cli.plot
WORKDIR` draws it beside the training reward).

8 prompts x 8 samples a step, 18 steps. A group of equal rewards carries no gradient and the
train step skips it, which pays for the 8 groups (4 a step left each update resting on 1-3 prompts).

Measured (run, 2-core Intel Xeon, `python -m benchmarks.april_vs_sync --config configs/smollm2_rl.py
--seeds 0,1,2`, compile cache off), greedy eval accuracy at versions 0 / 6 / 12 / 18:
seed 0: APRIL 0.32 / 0.35 / 0.47 / 0.47 (15.8 min); sync 0.32 / 0.44 / 0.46 / 0.46 (13.9 min);
seed 1: APRIL 0.32 / 0.48 / 0.46 / 0.49 (14.6 min); sync 0.32 / 0.49 / 0.57 / 0.69 (13.5 min);
seed 2: APRIL 0.32 / 0.29 / 0.45 / 0.50 (16.3 min); sync 0.32 / 0.39 / 0.55 / 0.54 (12.8 min).
docs/performance.md ("The real model with 8 groups a step") has the rest and the earlier configs.
"""

from april_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/smollm2_rl"
    c.model.path = "asset:smollm2-135m-instruct"
    c.data.task = "file"
    c.data.train_path = "asset:word-problems-train"
    c.data.eval_path = "asset:word-problems-eval"
    c.data.max_prompt_len = 64  # the longest prompt is 60 tokens (chat template and SmolLM2 system prompt included)
    c.reward.fn = "april_jax.data.word_problems:reward"
    c.reward.workers = 1  # the reward is a regex: one process keeps up

    c.rollout.engine = "jax"
    c.rollout.rollout_batch_size = 8  # 4 groups a step left each update resting on 1-3 prompts
    c.rollout.n_samples_per_prompt = 8
    c.rollout.over_sampling_batch_size = 16
    c.rollout.max_response_len = 64
    c.rollout.temperature = 0.5  # sampled accuracy at step 0: 3% at 1.0, 6% at 0.7 (greedy: 32%)
    c.rollout.max_num_seqs = 128
    c.rollout.smallest_prefill_bucket = 64  # prompts are 50-70 tokens: one or two prefill programs

    c.optimizer.lr = 1e-5
    c.optimizer.max_grad_norm = 1.0
    c.loss.clip_eps_low, c.loss.clip_eps_high = 0.2, 0.28
    c.train.total_steps = 18
    c.train.micro_batch_size = 8  # one group: a group of equal rewards (advantage 0) is not computed
    c.checkpoint.every = 6
    c.eval.every = 6
    c.eval.num_prompts = 100
    c.eval.n_samples = 1
    c.eval.temperature = 0.0
    return c
