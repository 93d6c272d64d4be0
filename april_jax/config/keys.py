"""The training config: every key declared once, with its default, type, allowed values and doc.

The schema is the `Config` dataclass below: its sections are dataclasses whose fields are
`schema.key(...)`s; `loss`, `optimizer` and `rollout` extend the runtime dataclasses (`LossConfig`,
`OptimizerConfig`, `RolloutConfig`), whose keys are declared where they are used. From it come
`default_config()` (the ml_collections ConfigDict that `configs/*.py` start from and
`--config.a.b=value` overrides), the per-key checks in `validate` (unknown keys fail with the nearest
key suggested; a wrong type, choice or bound names the key) and `python -m april_jax.train --help`.
`validate` adds the rules that relate keys; `loss_cfg`/`optimizer_cfg`/`rollout_cfg` resolve the
keys' config forms (0 = derived, 'none' = off) into the runtime dataclasses.
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from april_jax.config import schema
from april_jax.config.schema import ConfigError, key, section
from april_jax.models import qwen3
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig
from april_jax.rollout.config import RolloutConfig

__all__ = ["ConfigError", "Config", "default_config", "validate", "check_overrides", "help_text", "reward_spec"]

# Upper bounds that catch a typo (1e23 written out) before anything is built, not capacity plans:
# past them an allocation or a process count fails late (after the warm-up), or a seed wraps around.
MAX_TOKENS = 1 << 22  # a prompt or context, in tokens: beyond every model's context window
MAX_SEQS = 1 << 16  # sequences an engine decodes at once
MAX_WORKERS = 1024  # reward processes
MAX_SEED = 2**32 - 1  # jax.random.PRNGKey(2**32) is the key of seed 0


@dataclasses.dataclass(frozen=True)
class TinyModel:
    hidden_size: int = key(64, "width of the residual stream", gt=0)
    intermediate_size: int = key(128, "width of the MLP", gt=0)
    num_hidden_layers: int = key(2, "decoder layers", gt=0)
    num_attention_heads: int = key(4, "query heads", gt=0)
    num_key_value_heads: int = key(2, "key/value heads (grouped-query attention)", gt=0)
    head_dim: int = key(16, "width of one attention head", gt=0)
    rope_theta: float = key(
        1_000_000.0,
        "RoPE base (Qwen3's 1e6; a short-context task wants ~1e4, so that positions a few tokens apart differ)",
        gt=0,
    )


@dataclasses.dataclass(frozen=True)
class Model:
    path: str = key(
        "", "Hugging Face checkpoint dir (config.json + safetensors) or asset:NAME; empty: a random model of model.arch"
    )
    arch: str = key(
        "",
        "when model.path is empty: a preset of models/qwen3.py or 'tiny' (model.tiny.*)",
        choices=("", "tiny", *qwen3.PRESETS),
    )
    dtype: str = key("float32", "parameter (master weight) dtype", choices=tuple(qwen3.DTYPES))
    compute_dtype: str = key(
        "float32",
        "activation/matmul dtype (bfloat16 with float32 weights: mixed precision); the vLLM server runs in it",
        choices=tuple(qwen3.DTYPES),
    )
    remat: str = key(
        "none",
        "activation recomputation in the backward: 'full' keeps one activation per layer "
        "(long sequences), 'dots' keeps the matmuls",
        choices=tuple(qwen3.REMAT_POLICIES),
    )
    attention_impl: str = key(
        "auto",
        "attention kernel: 'auto' uses cuDNN flash attention on GPU in bf16/fp16, else XLA",
        choices=qwen3.ATTENTION_IMPLS,
    )
    lora_rank: int = key(
        0, "LoRA rank: > 0 trains adapters on a frozen base (the KL reference: adapters off); 0: full fine-tuning", ge=0
    )
    lora_alpha: float = key(
        32.0, "LoRA scaling numerator: the adapters' output is scaled by lora_alpha / lora_rank", gt=0
    )
    lora_targets: str = key(
        "all", "projections that get adapters: 'all' or a comma-separated subset of q,k,v,o,gate,up,down"
    )
    tiny: TinyModel = section(TinyModel, "the shape of model.arch='tiny' (vocabulary: the task's)")


@dataclasses.dataclass(frozen=True)
class Data:
    task: str = key(
        "file",
        "'file': prompts from data.train_path (jsonl/parquet); 'reverse': the synthetic "
        "digit-list task (with supervised warm-up data)",
        choices=("file", "reverse"),
    )
    train_path: str = key("", "training prompts, jsonl or parquet (or asset:NAME); needed when data.task='file'")
    eval_path: str = key("", "held-out prompts for eval/* (same format); empty: no eval set")
    prompt_key: str = key("prompt", "row field holding the prompt (a string or a list of chat messages)")
    answer_key: str = key("answer", "row field holding the reference answer the reward compares with")
    shuffle: bool = key(True, "shuffle the training rows (seeded by seed; each epoch anew)")
    chat_template: bool = key(True, "wrap prompts in the tokenizer's chat template")
    system_prompt: str = key("", "system message put before each prompt (chat template only); empty: none")
    chat_template_kwargs: str = key("", "JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'")
    max_prompt_len: int = key(512, "longest prompt in tokens (see data.overlong_prompt)", gt=0, le=MAX_TOKENS)
    overlong_prompt: str = key(
        "error",
        "a prompt longer than data.max_prompt_len: fail naming the row, or skip it (counted)",
        choices=("error", "skip"),
    )
    tokenizer_path: str = key(
        "", "dir with tokenizer.json (or asset:NAME, e.g. asset:qwen3-tokenizer); empty: model.path's"
    )
    reverse_lengths: str = key(
        "0.6:2-5,0.25:6-10,0.15:11-20",
        "data.task='reverse': list lengths as "
        "'P:LO-HI,...' (probability: digit range; the response is one token longer)",
    )


@dataclasses.dataclass(frozen=True)
class Reward:
    fn: str = key(
        "",
        "'math_verify', 'reverse' (the synthetic data.task='reverse' only) or your "
        "'module.path:function' (see rl/rewards.py); empty: the task's own (reverse for data.task="
        "'reverse', else math_verify)",
    )
    timeout_s: float = key(
        5.0, "per reward call; a stuck call's worker is killed and replaced, its reward is 0", gt=0, finite=True
    )
    workers: int = key(2, "scoring processes, working while the engine generates", gt=0, le=MAX_WORKERS)
    overlong_buffer: int = key(
        0, "DAPO soft overlong punishment: the last N tokens of the budget are penalised linearly; 0: off", ge=0
    )
    overlong_factor: float = key(1.0, "the penalty at the budget's end (reward.overlong_buffer > 0)", ge=0, finite=True)


@dataclasses.dataclass
class Rollout(RolloutConfig):
    engine: str = key(
        "jax",
        "generation engine: 'jax' (in-process), 'vllm' (a server), 'sim' (simulated lengths, no model)",
        choices=("jax", "vllm", "sim"),
    )
    max_num_seqs: int = key(
        64, "sequences the engine decodes at once (its slots); vllm: each server's", gt=0, le=MAX_SEQS
    )
    max_model_len: int = key(
        0,
        "longest prompt + response the engine holds (above the longest prompt); 0: "
        "data.max_prompt_len + rollout.max_response_len",
        ge=0,
        le=MAX_TOKENS,
    )
    vllm_urls: str = key("", "vllm: comma-separated servers to attach to; empty: one is launched")
    vllm_python: str = key(
        "",
        "vllm: interpreter with vllm installed (e.g. another venv); empty: this one if it "
        "has vllm, else the repo's .venv-vllm",
    )
    weight_transport: str = key(
        "shm",
        "vllm: how new weights reach the server (cuda_ipc: same GPU, untested)",
        choices=("shm", "file", "cuda_ipc"),
    )
    vllm_sleep_mode: bool = key(
        False,
        "vllm servers attached (rollout.vllm_urls) or on a CPU host: sleep (free their memory) during train "
        "steps; servers the trainer launches on GPUs sleep as the deployment plan says",
    )
    decode_steps_per_call: int = key(8, "jax engine: decode steps per jitted call (fewer: slots refill sooner)", gt=0)
    merge_padding_tokens: int = key(
        0,
        "jax engine: a prefill or extend call may pad this many tokens to serve two "
        "length buckets at once (one call less; on small models a call's fixed cost "
        "exceeds that compute)",
        ge=0,
    )
    smallest_prefill_bucket: int = key(
        16,
        "jax engine: the shortest prompt-length bucket of a prefill call (larger: "
        "fewer programs to compile, more padding)",
        gt=0,
    )
    reuse_aborted_kv: bool = key(
        False,
        "jax engine: resume partial responses from a side cache of their KV (no re-prefill); "
        "takes the place of hold_aborted_kv",
    )
    hold_aborted_kv: bool = key(
        True,
        "jax engine: an aborted response's KV stays in its slot until the response "
        "resumes there (no re-prefill, no copy) or the slot is needed; survives the "
        "train step only with free_kv_cache_in_train=false (else it is dropped there, "
        "costing nothing). vllm: the server's prefix cache is kept through weight syncs "
        "(reset once its oldest KV is more than rollout.max_staleness versions old; "
        "always with vllm_sleep_mode), so resumed responses are not prefilled again",
    )
    free_kv_cache_in_train: bool = key(
        True, "jax engine: free its KV cache during train steps (verl's free_cache_engine)"
    )
    deployment: str = key(
        "colocated",
        "where rollout runs on a GPU node: 'colocated' (every GPU trains and serves) or 'disaggregated' "
        "(rollout.gpus serve, the rest train); the deployment plan (--plan) lays it out",
        choices=("colocated", "disaggregated"),
    )
    gpus: int = key(0, "disaggregated: GPUs that serve rollout; 0: half of them", ge=0, le=MAX_WORKERS)
    tensor_parallel: int = key(
        0, "vllm: tensor-parallel size of each server; 0: the plan's (the smallest whose KV cache fits)", ge=0, le=64
    )
    servers: int = key(
        0, "vllm on a CPU host: servers to launch, each pinned to its own cores; 0: one (GPUs: one per GPU group)", ge=0
    )
    kv_cache_bytes: int = key(
        0,
        "vllm: KV cache bytes a GPU of each server; 0: what the plan leaves (capped at max_num_seqs full sequences)",
        ge=0,
    )
    enforce_eager: bool = key(False, "vllm on a GPU: no CUDA graphs (CPU servers are always eager)")
    engine_devices: int = key(
        0,
        "jax engine: how many of process 0's devices it runs on (a copy of the weights, "
        "refreshed at each sync); 0: all of them (one process: the trainer's own arrays)",
        ge=0,
    )


@dataclasses.dataclass(frozen=True)
class Loss(LossConfig):
    clip_c: float = key(0.0, "dual-clip constant for negative advantages (e.g. 3.0); 0: off", ge=0, finite=True)
    norm_len: int = key(0, "seq-mean-token-sum-norm's constant (Dr. GRPO); 0: rollout.max_response_len", ge=0)
    tis: str = key(
        "token",
        "truncated importance sampling of pi_old / pi_behaviour, per token or per sequence; 'none': off",
        choices=("token", "sequence", "none"),
    )
    ref_path: str = key("", "KL reference (HF checkpoint dir) when loss.kl_coef > 0; empty: the initial policy")
    advantage: str = key(
        "grpo",
        "advantage estimator: grpo (group mean/std), drgrpo (group mean, no std), rloo (leave-one-out mean)",
        choices=("grpo", "drgrpo", "rloo"),
    )
    advantage_batch_norm: bool = key(
        False,
        "afterwards, whiten the advantages over the whole batch (minus its mean, over its std; REINFORCE++-style)",
    )


@dataclasses.dataclass(frozen=True)
class Train:
    total_steps: int = key(100, "train steps (one rollout batch each)", gt=0)
    micro_batch_size: int = key(
        0,
        "sequences per forward/backward (gradients accumulate); 0: the whole batch; "
        "must divide rollout_batch_size x n_samples_per_prompt; without a KL or entropy term a micro-batch "
        "of only zero-advantage rows is skipped: n_samples_per_prompt skips every group of equal rewards",
        ge=0,
    )
    num_iterations: int = key(1, "PPO epochs (optimiser steps) over each rollout batch", gt=0)
    max_skipped_steps: int = key(
        3, "stop with an error after this many consecutive skipped (non-finite or all-rewards-failed) steps", gt=0
    )
    offload: str = key(
        "auto",
        "the optimizer state on the host while the engine generates (back before the update, bit-identical): "
        "'auto' when the deployment plan needs the room",
        choices=("auto", "on", "off"),
    )
    compile_cache_dir: str = key(
        "~/.cache/april_jax/xla",
        "persistent XLA compilation cache: a rerun or resumed "
        "run loads the programs compiled before (same metrics); JAX_COMPILATION_CACHE_DIR "
        "in the environment wins; empty: off (april_jax/runtime/compile_cache.py)",
    )


@dataclasses.dataclass(frozen=True)
class Warmup:
    steps: int = key(0, "supervised steps on the task's warm-up examples before RL (fresh runs only); 0: none", ge=0)
    lr: float = key(3e-3, "peak learning rate of the warm-up (Adam, cosine)", ge=0, finite=True)
    batch_size: int = key(64, "examples per warm-up step", gt=0)
    reverse_frac: float = key(
        1.0,
        "reverse task: share of exact reversals (paid in full) among the examples; the "
        "rest end with a stray '=' before <eos>",
        ge=0,
        le=1,
    )


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    every: int = key(10, "save every N train steps (and after the last)", gt=0)
    keep: int = key(3, "checkpoints kept (the newest)", gt=0)


@dataclasses.dataclass(frozen=True)
class Eval:
    every: int = key(0, "evaluate on data.eval_path every N steps (and before step 0); 0: off", ge=0)
    num_prompts: int = key(64, "held-out prompts per evaluation", ge=0)
    n_samples: int = key(4, "samples per prompt: eval/avg@k averages over them", gt=0)
    temperature: float = key(0.6, "eval sampling temperature (0: greedy)", ge=0, finite=True)


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int = key(1, "data-parallel axis size (-1: the remaining devices)", ge=-1)
    fsdp: int = key(-1, "fully-sharded axis size (-1: the remaining devices)", ge=-1)
    tensor: int = key(1, "tensor-parallel axis size (-1: the remaining devices)", ge=-1)


@dataclasses.dataclass(frozen=True)
class Log:
    tensorboard: bool = key(True, "write WORKDIR/tensorboard event files beside metrics.jsonl")
    progress: bool = key(True, "one progress line per step on stderr")
    wandb_project: str = key("", "Weights & Biases project; empty: off (pip install 'april_jax[wandb]')")
    wandb_mode: str = key(
        "online",
        "'offline': no network (`wandb sync WORKDIR/wandb/offline-run-*` later)",
        choices=("online", "offline", "disabled"),
    )


@dataclasses.dataclass(frozen=True)
class Config:
    workdir: str = key("runs/default", "where the run writes (checkpoints, metrics); rerun to resume")
    seed: int = key(0, "seeds the model init, data order, sampling and the synthetic task", ge=0, le=MAX_SEED)
    model: Model = section(Model, "the policy")
    data: Data = section(Data, "prompts and their tokenization")
    reward: Reward = section(Reward, "scoring responses")
    rollout: Rollout = section(Rollout, "APRIL and the generation engine")
    loss: Loss = section(Loss, "the policy loss")
    optimizer: OptimizerConfig = section(OptimizerConfig, "the policy update")
    train: Train = section(Train, "the training loop")
    warmup: Warmup = section(Warmup, "supervised warm-up before RL")
    checkpoint: Checkpoint = section(Checkpoint, "orbax checkpoints in WORKDIR/checkpoints")
    eval: Eval = section(Eval, "held-out evaluation")
    mesh: Mesh = section(Mesh, "device mesh axes (one may be -1)")
    log: Log = section(Log, "metrics sinks (metrics.jsonl always)")


SPECS = schema.specs(Config)
# keys the runtime dataclasses check themselves when rollout_cfg / loss_cfg build them (the same
# generated checks; the message reads `rollout.key=value: why`, as when they are built without a config)
SELF_CHECKED = frozenset(schema.specs(RolloutConfig, "rollout.")) | frozenset(schema.specs(LossConfig, "loss."))


def default_config() -> ml_collections.ConfigDict:
    """Every key at its default (what `configs/*.py` start from)."""
    return schema.to_configdict(Config)


def help_text(prefix: str = "") -> str:
    """Every key under `prefix` ('' for all) with its type, default, allowed values and doc."""
    if prefix and not any(name == prefix or name.startswith(prefix + ".") for name in SPECS):
        near = schema.nearest(prefix, set(SPECS) | set(schema.section_docs(Config)))
        raise ConfigError(f"no config key {prefix!r}" + (f"; did you mean {near!r}?" if near else ""))
    return schema.help_text(Config, prefix)


def check_overrides(argv: list[str], flag: str = "config") -> None:
    """`--config.x.y=value` args: each key known (else the nearest is suggested) and each value of its type."""
    for arg in argv:
        if not arg.startswith(f"--{flag}."):
            continue
        name, has_value, text = arg[len(flag) + 3 :].partition("=")
        if name not in SPECS:
            near = schema.nearest(name, SPECS)
            raise ConfigError(f"unknown config key {name!r}" + (f"; did you mean --{flag}.{near}?" if near else ""))
        if has_value:
            SPECS[name].parse(text)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The generated per-key checks, then the rules that relate keys; returns `c`."""
    if not isinstance(
        c, ml_collections.ConfigDict
    ):  # a config file's get_config() forgot to return it, or built its own
        raise ConfigError(
            f"config: get_config() returned {type(c).__name__}, not a ConfigDict (start from "
            "april_jax.config.default_config(), change keys, and return it)"
        )
    schema.check_values(schema.flat(c), SPECS, skip=SELF_CHECKED)
    rollout_cfg(c)  # before the rules below: a bad rollout key is blamed, not what uses it
    loss_cfg(c)
    lora_cfg(c)
    batch = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    if c.train.micro_batch_size and batch % c.train.micro_batch_size:
        raise ConfigError(
            f"config key 'train.micro_batch_size'={c.train.micro_batch_size} does not divide the batch "
            f"of rollout.rollout_batch_size x rollout.n_samples_per_prompt = {batch} sequences"
        )
    axes = {axis: c.mesh[axis] for axis in ("data", "fsdp", "tensor")}
    for axis, size in axes.items():
        if size == 0:
            raise ConfigError(f"config key 'mesh.{axis}'=0: must be > 0 or -1 (the remaining devices)")
    if list(axes.values()).count(-1) > 1:
        raise ConfigError(f"config: at most one mesh axis may be -1, got {axes}")
    if not c.model.path and not c.model.arch:
        raise ConfigError("config: set model.path (a Hugging Face checkpoint dir) or model.arch")
    if c.data.task == "file" and not c.data.train_path:
        raise ConfigError("config key 'data.train_path' is empty (data.task='file' needs a jsonl/parquet file)")
    chat_template_kwargs(c)
    reward_spec(c)
    vllm_url_list(c.rollout.vllm_urls)
    return c


def vllm_url_list(value: str) -> list[str]:
    """`rollout.vllm_urls` as a list, each checked for form: any other scheme would be tried as HTTP
    and fail seconds later on /health without saying why."""
    from urllib.parse import urlsplit

    urls = [u.strip() for u in value.split(",") if u.strip()]
    for url in urls:
        where = f"config key 'rollout.vllm_urls': {url!r}"
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as e:
            raise ConfigError(f"{where}: not a URL ({e}); e.g. http://10.0.0.5:8000") from None
        if parts.scheme not in ("http", "https"):
            raise ConfigError(
                f"{where}: scheme {parts.scheme or '(none)'!r}; vLLM servers answer http:// or https://, "
                "e.g. http://10.0.0.5:8000"
            )
        if not parts.hostname:
            raise ConfigError(f"{where}: no host; e.g. http://10.0.0.5:8000")
    return urls


REWARD_BUILTINS = ("math_verify", "reverse")


def reward_spec(c) -> str:
    """`reward.fn` resolved for `data.task` ('' is the task's own), checked for form only: importing
    the module is for the trainer (rewards.load_function), once it is about to score."""
    spec, task = c.reward.fn.strip(), c.data.task
    if not spec:
        return "reverse" if task == "reverse" else "math_verify"
    where = f"config key 'reward.fn'={c.reward.fn!r}"
    if spec == "reverse" and task != "reverse":
        raise ConfigError(
            f"{where}: scores the synthetic data.task='reverse' only (data.task={task!r}: use "
            "'math_verify' or your 'module.path:function')"
        )
    if spec == "math_verify" and task == "reverse":
        raise ConfigError(
            f"{where}: data.task='reverse' answers are digit lists, scored by 'reverse' (or your "
            "'module.path:function'; empty: the task's own)"
        )
    if spec in REWARD_BUILTINS:
        return spec
    module, colon, name = spec.partition(":")
    if not colon:
        head, dot, tail = spec.rpartition(".")
        hint = f"; did you mean {head + ':' + tail!r}?" if dot and head and tail.isidentifier() else ""
        raise ConfigError(
            f"{where}: expected 'math_verify', 'reverse' or 'module.path:function' (no ':' before "
            f"the function's name){hint}"
        )
    if not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(f"{where}: {module!r} is not a module path (dotted names, e.g. 'my_pkg.rewards')")
    if not name.isidentifier():
        raise ConfigError(f"{where}: {name!r} is not a function name")
    return spec


def chat_template_kwargs(c) -> dict:
    """`data.chat_template_kwargs` (a JSON object string) as a dict."""
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


def _fields(cls, section_dict) -> dict:
    return {f.name: section_dict[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def rollout_cfg(c, stop_token_ids=()) -> RolloutConfig:
    try:
        return RolloutConfig(**_fields(RolloutConfig, c.rollout), stop_token_ids=tuple(stop_token_ids)).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def loss_cfg(c) -> LossConfig:
    """The loss's keys in their runtime form: 0/'none' mean off, norm_len 0 the generation budget,
    and the staleness cap is rollout.max_staleness (one key for the rollout and the loss)."""
    fields = _fields(LossConfig, c.loss)
    fields.update(
        clip_c=c.loss.clip_c or None,
        tis=None if c.loss.tis == "none" else c.loss.tis,
        norm_len=c.loss.norm_len or c.rollout.max_response_len,
        max_staleness=c.rollout.max_staleness,
    )
    try:
        return LossConfig(**fields).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def lora_cfg(c, base: dict | None = None):
    """The LoRAConfig of model.lora_*, or None (lora_rank 0: full fine-tuning)."""
    from april_jax.models.lora import LoRAConfig, parse_targets

    try:
        targets = parse_targets(c.model.lora_targets)
    except ValueError as e:
        raise ConfigError(f"config key 'model.lora_targets'={c.model.lora_targets!r}: {e}") from None
    if not c.model.lora_rank:
        if c.model.lora_targets.strip() != "all":
            raise ConfigError(
                f"config key 'model.lora_targets'={c.model.lora_targets!r} needs model.lora_rank > 0 (it is 0: full fine-tuning)"
            )
        return None
    return LoRAConfig(c.model.lora_rank, float(c.model.lora_alpha), targets, seed=c.seed, base=base)


def optimizer_cfg(c) -> OptimizerConfig:
    fields = _fields(OptimizerConfig, c.optimizer)
    # the schedule counts optimiser steps: one per PPO epoch of every train step
    fields["total_steps"] = c.optimizer.total_steps or c.train.total_steps * c.train.num_iterations
    return OptimizerConfig(**fields)
