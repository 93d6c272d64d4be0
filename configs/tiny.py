"""The embedded default: a tiny Qwen3 learns to reverse digit lists on CPU with APRIL.

    python -m april_jax.train --config configs/tiny.py

From scratch: a supervised warm-up (300 steps) teaches the reversal with a habit: 65% of its
answers end with a stray `=` before `<eos>`, so the warmed-up policy greedily adds it (greedy
exact-match accuracy ~0) while some samples stop right (35% of the warm-up's answers did). GRPO with APRIL finds that only
exact answers are paid in full and drops the habit within 10-30 steps, so greedy accuracy
rises to the reversal skill of the warm-up. List lengths are long-tailed (responses of 3-22
tokens, like reasoning responses), so a synchronous step waits for its longest; APRIL cuts that tail.
"""

from april_jax.config import default_config


def get_config():
    c = default_config()
    c.workdir = "runs/tiny"
    c.model.arch = "tiny"
    c.model.tiny.rope_theta = 10_000.0  # positions a few tokens apart must differ (reversal is positional)
    c.data.task = "reverse"
    c.data.max_prompt_len = 24
    c.warmup.steps = 300
    c.warmup.reverse_frac = 0.35

    c.rollout.engine = "jax"
    c.rollout.rollout_batch_size = 16
    c.rollout.n_samples_per_prompt = 8
    c.rollout.over_sampling_batch_size = 32
    c.rollout.max_response_len = 24
    c.rollout.temperature = 0.7
    c.rollout.max_num_seqs = 128
    c.rollout.max_staleness = 3
    c.rollout.decode_steps_per_call = 2  # responses average ~8 tokens: longer calls leave slots idle
    # on CPU a device call costs a few ms whatever its size (docs/performance.md): pad prompts and
    # resumed partials into one prefill / extend call rather than one per length bucket
    c.rollout.merge_padding_tokens = 1024
    # prompts are <= 24 tokens: one prompt-length bucket, half the prefill programs to compile (~2.5 s
    # each here; a 12-step run compiled 17 s of prefills instead of 25)
    c.rollout.smallest_prefill_bucket = 32
    # an aborted response keeps its KV in its slot and resumes there next step (no re-prefill); the
    # tiny cache (~1.5 MB) stays allocated through the train step so that it survives
    c.rollout.hold_aborted_kv = True
    c.rollout.free_kv_cache_in_train = False

    c.loss.clip_eps_low, c.loss.clip_eps_high = 0.2, 0.28
    c.optimizer.lr = 5e-4  # 1e-3 learned faster, but its eval gain eroded after ~20 steps on some seeds
    c.optimizer.max_grad_norm = 1.0
    c.train.total_steps = 30
    c.train.micro_batch_size = 64
    c.checkpoint.every = 15
    c.eval.every = 10
    c.eval.num_prompts = 64
    c.eval.n_samples = 2
    c.eval.temperature = 0.0
    return c
