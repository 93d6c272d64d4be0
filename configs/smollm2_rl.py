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

Measured (run, idle 2-core VM, `python -m benchmarks.april_vs_sync --config configs/smollm2_rl.py
--seeds 2,0,1`, compile cache off), greedy eval accuracy at versions 0 / 4 / 8 / 12:
seed 2: APRIL 0.32 / 0.18 / 0.23 / 0.22 (13.4 min); sync 0.32 / 0.37 / 0.42 / 0.51 (12.3 min);
seed 0: APRIL 0.32 / 0.37 / 0.35 / 0.47 (13.1 min); sync 0.32 / 0.35 / 0.45 / 0.47 (11.6 min);
seed 1: APRIL 0.32 / 0.40 / 0.44 / 0.45 (13.6 min); sync 0.32 / 0.46 / 0.45 / 0.51 (11.7 min).
Seed 2 with `--config.rollout.max_staleness=0`: APRIL 0.32 / 0.31 / 0.38 / 0.49 (docs/performance.md).
Seeds 3 / 4 (2-core AMD EPYC, 21.5-24.3 min a run): APRIL 0.32 -> 0.48 / 0.43; sync 0.32 -> 0.42 / 0.47.
Since one epoch takes pi_old from the update's own forward, seed 3 there: 19.7 (APRIL) / 19.0 min.
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
    c.rollout.rollout_batch_size = 4
    c.rollout.n_samples_per_prompt = 8
    c.rollout.over_sampling_batch_size = 8
    c.rollout.max_response_len = 64
    c.rollout.temperature = 0.5  # sampled accuracy at step 0: 3% at 1.0, 6% at 0.7 (greedy: 32%)
    c.rollout.max_num_seqs = 64
    c.rollout.smallest_prefill_bucket = 64  # prompts are 50-70 tokens: one or two prefill programs

    c.optimizer.lr = 1e-5
    c.optimizer.max_grad_norm = 1.0
    c.loss.clip_eps_low, c.loss.clip_eps_high = 0.2, 0.28
    c.train.total_steps = 12
    c.train.micro_batch_size = 16
    c.checkpoint.every = 4
    c.eval.every = 4
    c.eval.num_prompts = 100
    c.eval.n_samples = 1
    c.eval.temperature = 0.0
    return c
