"""The training config: schema, defaults and validation, in one place.

Config files (`configs/*.py`) define `get_config()` that starts from `default_config()` and
changes fields; the command line overrides any field with `--config.a.b=value`. Unknown keys
fail before anything starts, with the nearest valid key suggested; a value of the wrong type
names the key and the expected type.
"""

from __future__ import annotations

import difflib
import math
import sys

import ml_collections

from april_jax.models import qwen3
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig
from april_jax.rollout.april import RolloutConfig


class ConfigError(ValueError):
    """A bad config key or value; the message names it."""


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # Hugging Face checkpoint dir; empty: a random model of `model.arch`
    c.model.arch = ""  # preset name (qwen3-0.6b ... qwen3-8b) or "tiny" (model.tiny.*) when path is empty
    c.model.dtype = "float32"  # parameter dtype
    c.model.compute_dtype = "float32"
    c.model.remat = "none"  # "none", "full" (recompute each layer in the backward: long sequences), "dots"
    c.model.attention_impl = "auto"  # "auto" (cuDNN flash attention on GPU in bf16/fp16), "xla", "cudnn"
    c.model.tiny = ml_collections.ConfigDict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16))

    c.data = ml_collections.ConfigDict()
    c.data.task = "file"  # "file" (jsonl/parquet) or "reverse" (the synthetic tiny task)
    c.data.train_path = ""
    c.data.eval_path = ""
    c.data.prompt_key = "prompt"
    c.data.answer_key = "answer"
    c.data.shuffle = True
    c.data.chat_template = True  # wrap prompts in the tokenizer's chat template
    c.data.system_prompt = ""
    c.data.chat_template_kwargs = ""  # JSON object passed to the chat template, e.g. '{"enable_thinking": false}'
    c.data.max_prompt_len = 512
    c.data.overlong_prompt = "error"  # a prompt longer than max_prompt_len: "error" (names the row) or "skip"
    c.data.tokenizer_path = ""  # dir with tokenizer.json; empty: model.path ("asset:qwen3-tokenizer": real Qwen3)

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = "math_verify"  # "math_verify", "reverse" (tiny task) or "module.path:function" (rl/rewards.py)
    c.reward.timeout_s = 5.0  # per call; a stuck call's worker is killed and replaced, the reward is 0
    c.reward.workers = 2  # scoring processes, working while the engine generates
    c.reward.overlong_buffer = 0  # DAPO soft overlong punishment window in tokens (0: off)
    c.reward.overlong_factor = 1.0

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "jax"  # "jax", "vllm", "sim"
    for field, value in RolloutConfig().__dict__.items():
        if field != "stop_token_ids":
            setattr(c.rollout, field, value)
    c.rollout.max_num_seqs = 64
    c.rollout.max_model_len = 0  # 0: max_prompt_len + max_response_len
    c.rollout.vllm_urls = ""  # comma-separated servers to attach to (vllm engine); else one is launched
    c.rollout.vllm_python = ""  # interpreter with vllm installed (its own venv); empty: this one
    c.rollout.weight_transport = "shm"  # vllm: "shm", "file" or "cuda_ipc" (GPU, untested)
    c.rollout.vllm_sleep_mode = False  # vllm colocated on the trainer's GPU: sleep while training
    c.rollout.decode_steps_per_call = 8  # jax engine: decode steps per jitted call
    c.rollout.reuse_aborted_kv = False  # jax engine: resume partials from their parked KV (no re-prefill)
    c.rollout.free_kv_cache_in_train = True  # jax engine: free its KV cache during train steps (verl's free_cache_engine)

    # loss.max_staleness is not a key: the loss masks exactly what rollout.max_staleness allows
    c.loss = ml_collections.ConfigDict({k: v for k, v in LossConfig().__dict__.items() if k != "max_staleness"})
    c.loss.norm_len = 0  # seq-mean-token-sum-norm's constant; 0: rollout.max_response_len
    c.loss.ref_path = ""  # KL reference (HF checkpoint dir) when kl_coef > 0; empty: the initial policy
    c.loss.clip_c = 0.0  # dual-clip constant for negative advantages (e.g. 3.0); 0: off
    c.loss.advantage = "grpo"  # "grpo", "drgrpo", "rloo"
    c.loss.advantage_batch_norm = False
    c.loss.tis = "token"

    c.optimizer = ml_collections.ConfigDict(dict(OptimizerConfig().__dict__))
    c.optimizer.total_steps = 0  # optimiser steps of the cosine schedule; 0: train.total_steps x train.num_iterations

    c.train = ml_collections.ConfigDict()
    c.train.total_steps = 100
    c.train.micro_batch_size = 0  # 0: the whole batch at once
    c.train.num_iterations = 1  # PPO epochs over each rollout
    c.train.max_skipped_steps = 3  # stop with an error after this many consecutive skipped (non-finite) steps

    c.warmup = ml_collections.ConfigDict()  # supervised warm-up before RL (fresh runs only)
    c.warmup.steps = 0
    c.warmup.lr = 3e-3
    c.warmup.batch_size = 64
    c.warmup.reverse_frac = 1.0  # share of reversed (rewarded) answers; the rest are copies of the list

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 3

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 0  # steps; 0: off
    c.eval.num_prompts = 64
    c.eval.n_samples = 4  # avg@k
    c.eval.temperature = 0.6

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.log = ml_collections.ConfigDict(dict(tensorboard=True, progress=True))
    c.log.wandb_project = ""  # Weights & Biases project; empty: off (pip install 'april_jax[wandb]')
    c.log.wandb_mode = "online"  # "online", "offline" (no network; `wandb sync WORKDIR/wandb/offline-run-*` later)
    return c


def _flat(c: ml_collections.ConfigDict, prefix: str = "") -> dict:
    out = {}
    for key, value in c.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def check_overrides(argv: list[str], flag: str = "config") -> None:
    """Fail on `--config.x.y=...` keys that are not in the schema, suggesting the nearest one."""
    known = _flat(default_config())
    for arg in argv:
        if not arg.startswith(f"--{flag}."):
            continue
        key = arg[len(flag) + 3:].split("=", 1)[0]
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            hint = f"; did you mean --{flag}.{near[0]}?" if near else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Schema check (keys and types) plus cross-field rules; returns `c`."""
    known, given = _flat(default_config()), _flat(c)
    for key, value in given.items():
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            raise ConfigError(f"unknown config key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        expected = known[key]
        if expected is None or value is None:
            continue
        ok = isinstance(value, type(expected)) or (isinstance(expected, float) and isinstance(value, int)
                                                    and not isinstance(value, bool))
        if isinstance(expected, int) and not isinstance(expected, bool) and isinstance(value, bool):
            ok = False
        if not ok:
            raise ConfigError(f"config key {key!r} expects {type(expected).__name__}, got {value!r} "
                              f"({type(value).__name__})")
    choices = {"rollout.engine": ("jax", "vllm", "sim"), "data.task": ("file", "reverse"),
               "data.overlong_prompt": ("error", "skip"), "optimizer.schedule": ("constant", "cosine"),
               "rollout.weight_transport": ("shm", "file", "cuda_ipc"),
               "loss.advantage": ("grpo", "drgrpo", "rloo"), "model.dtype": tuple(qwen3.DTYPES),
               "model.compute_dtype": tuple(qwen3.DTYPES), "model.remat": tuple(qwen3.REMAT_POLICIES),
               "model.attention_impl": qwen3.ATTENTION_IMPLS}
    for key, allowed in choices.items():
        if given[key] not in allowed:
            raise ConfigError(f"config key {key!r}={given[key]!r}: expected one of {allowed}")
    for key in ("train.total_steps", "checkpoint.every", "checkpoint.keep", "train.num_iterations",
                "rollout.decode_steps_per_call", "train.max_skipped_steps", "warmup.batch_size", "reward.workers",
                "data.max_prompt_len", "rollout.max_num_seqs", "eval.n_samples"):
        if given[key] <= 0:
            raise ConfigError(f"config key {key!r}={given[key]}: must be > 0")
    for key in ("loss.norm_len", "optimizer.total_steps", "loss.kl_coef", "train.micro_batch_size", "warmup.steps",
                "eval.every", "eval.num_prompts", "rollout.max_model_len", "reward.overlong_buffer"):
        if given[key] < 0:
            raise ConfigError(f"config key {key!r}={given[key]}: must be >= 0")
    if not 0.0 <= c.warmup.reverse_frac <= 1.0:
        raise ConfigError(f"config key 'warmup.reverse_frac'={c.warmup.reverse_frac}: must be in [0, 1]")
    for key in ("optimizer.lr", "warmup.lr"):
        if not math.isfinite(given[key]) or given[key] < 0:
            raise ConfigError(f"config key {key!r}={given[key]}: must be a finite number >= 0")
    rollout_cfg(c)  # before the cross-field rules below: a bad rollout key is blamed, not what uses it
    loss_cfg(c)
    batch = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    if c.train.micro_batch_size and batch % c.train.micro_batch_size:
        raise ConfigError(f"config key 'train.micro_batch_size'={c.train.micro_batch_size} does not divide the batch "
                          f"of rollout.rollout_batch_size x rollout.n_samples_per_prompt = {batch} sequences")
    if c.warmup.steps and c.data.task != "reverse":
        raise ConfigError("config key 'warmup.steps' > 0 needs data.task='reverse' (the task with supervised examples)")
    if not c.model.path and not c.model.arch:
        raise ConfigError("config: set model.path (a Hugging Face checkpoint dir) or model.arch")
    if c.data.task == "file" and not c.data.train_path:
        raise ConfigError("config key 'data.train_path' is empty (data.task='file' needs a jsonl/parquet file)")
    if c.log.wandb_mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"config key 'log.wandb_mode'={c.log.wandb_mode!r}: expected 'online', 'offline' or 'disabled'")
    chat_template_kwargs(c)
    return c


def chat_template_kwargs(c) -> dict:
    """`data.chat_template_kwargs` (a JSON object string) as a dict."""
    import json

    text = c.data.chat_template_kwargs.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config key 'data.chat_template_kwargs'={text!r}: not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"config key 'data.chat_template_kwargs'={text!r}: expected a JSON object")
    return value


def rollout_cfg(c, stop_token_ids=()) -> RolloutConfig:
    fields = {k: c.rollout[k] for k in RolloutConfig().__dict__ if k != "stop_token_ids"}
    try:
        return RolloutConfig(**fields, stop_token_ids=tuple(stop_token_ids)).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def loss_cfg(c) -> LossConfig:
    fields = {k: c.loss[k] for k in LossConfig().__dict__ if k != "max_staleness"}
    fields["tis"] = None if fields["tis"] in ("", "none", None) else fields["tis"]
    fields["clip_c"] = fields["clip_c"] or None
    fields["norm_len"] = c.loss.norm_len or c.rollout.max_response_len
    fields["max_staleness"] = c.rollout.max_staleness
    try:
        return LossConfig(**fields).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def optimizer_cfg(c) -> OptimizerConfig:
    fields = {k: c.optimizer[k] for k in OptimizerConfig().__dict__}
    # the schedule counts optimiser steps: one per PPO epoch of every train step
    fields["total_steps"] = c.optimizer.total_steps or c.train.total_steps * c.train.num_iterations
    return OptimizerConfig(**fields)


def fail(message: str) -> "None":
    """One clear line on stderr and exit 2: bad input is not a traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
