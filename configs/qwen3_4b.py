"""Qwen3-4B GRPO/DAPO with APRIL, the seed's settings: 32 prompts x 8 samples, over-sampling 64,
temperature 0.8, lr 1e-6, clip 0.2/0.28, max response 16384, bf16, mesh over all devices.

    python -m april_jax.train --config configs/qwen3_4b.py \
        --config.model.path=/ckpt/Qwen3-4B --config.data.train_path=/data/dapo-math-17k.parquet
"""

from april_jax.config import default_config


def get_config(size: str = "4b"):
    c = default_config()
    c.workdir = f"runs/qwen3_{size}"
    c.model.path = (
        f"/path/to/Qwen3-{size.upper()}"  # a Hugging Face checkpoint dir (config.json, safetensors, tokenizer)
    )
    # fp32 master weights, bf16 compute (as verl/FSDP mixed precision): with bf16 weights ~98% of
    # AdamW's lr-1e-6 updates round away (benchmarks/gpu_bf16_update.py; docs/performance.md).
    c.model.dtype = "float32"
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "full"  # 16K-token responses: keep one activation per layer, recompute the rest
    c.data.task = "file"
    c.data.train_path = "/path/to/train.parquet"  # jsonl or parquet with fields prompt / answer
    c.data.eval_path = ""
    c.data.max_prompt_len = 1024
    c.reward.fn = "math_verify"
    c.reward.workers = 8

    c.rollout.engine = "vllm"
    c.rollout.rollout_batch_size = 32
    c.rollout.n_samples_per_prompt = 8
    c.rollout.over_sampling_batch_size = 64
    c.rollout.partial_rollout = True
    c.rollout.max_response_len = 16384
    c.rollout.temperature = 0.8
    c.rollout.max_staleness = 4  # the seed: a response spans at most 5 policy versions
    c.rollout.max_num_seqs = 512
    # APRIL's in-flight design is the product default (refill="members", inflight="auto", finish_wait,
    # inflight_headroom). The servers share the trainer's GPUs (rollout.deployment="colocated", the
    # default); the deployment plan (`--plan`) splits each GPU between them at start, so the servers
    # stay awake with their KV through the update where both fit, and sleep only where they must:
    # `python -m benchmarks.rollout --engine sim --config configs/qwen3_4b.py --plan-devices 8xH200-141GB`
    # simulates what the plan launches.

    c.loss.clip_eps_low, c.loss.clip_eps_high = 0.2, 0.28
    c.loss.loss_agg_mode = "token-mean"
    c.loss.kl_coef = 0.0
    c.loss.staleness_decay = 0.9
    c.optimizer.lr = 1e-6
    c.optimizer.weight_decay = 0.1
    c.optimizer.max_grad_norm = 1.0
    c.train.total_steps = 1000
    c.train.micro_batch_size = 8
    c.checkpoint.every = 20
    c.eval.every = 20
    c.eval.n_samples = 16
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    return c
