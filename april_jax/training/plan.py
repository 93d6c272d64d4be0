"""The deployment plan: which devices train and which serve rollout, how many vLLM servers at which
tensor-parallel size, and the bytes every device holds. Computed from the config and the devices
(`devices.parse_spec` or this host), before anything starts; a run launches what it says.

    python -m april_jax.train --config FILE --plan [--plan-devices 8xH100-80GB] [--json]

Layouts (`rollout.deployment`, the word the simulator's `--deployment` uses):
- colocated: every GPU trains and serves. A server's memory and the trainer's are split once, at
  start (JAX preallocates `XLA_PYTHON_CLIENT_MEM_FRACTION`, the server gets the rest): both then
  stay resident, the server keeps its KV cache through the update (no sleep, so APRIL's resumed
  responses find their prefix) and the trainer never waits for memory. When the two do not fit
  side by side, the plan time-shares instead: JAX's platform allocator (memory returns to the
  driver when freed), the optimizer state on the host during rollout, and the server asleep
  (level 1: weights to host, KV dropped) during the update.
- disaggregated: `rollout.gpus` GPUs serve (default half), the others train.

Trainer bytes per device (parameters sharded over fsdp x tensor, rows over data x fsdp):
    parameters, gradients    P x dtype bytes / shards each (gradients in the parameters' dtype);
                             LoRA (model.lora_rank > 0): the base in the compute dtype + fp32
                             adapters, gradients and optimizer state of the adapters only
    optimizer state          AdamW's two moments: 2 x P x dtype bytes / shards
    reference                P x dtype bytes / shards when loss.kl_coef > 0
    gathered weights         one layer and the embedding in the compute dtype, twice (FSDP prefetch)
    activations              rows x T x per-layer bytes, by model.remat: 'full' keeps one residual
                             a layer and recomputes one layer at a time, 'dots' the matmul outputs,
                             'none' everything; T = the longest prompt + response
    attention scores         0 with cuDNN's fused attention (a GPU in bf16/fp16); else XLA's one
                             layer of [heads, T, T] fp32 scores and probabilities a row
    log-probabilities        rows x chunk x vocabulary x 4 bytes x 3 (logits, exp, gradient): the
                             train step computes them `rl.train_step.LOGPROB_CHUNK` positions at a time
    XLA margin               10% of the above + 1 GB (fusion scratch, fragmentation): an assumption
                             until a GPU run's `memory_stats` peak replaces it
    runtime                  0.5 GB a process (CUDA context, cuBLAS / cuDNN workspaces)
Server bytes per device (tensor parallel t):
    weights                  P x compute bytes / t
    activations              a prefill of max_num_batched_tokens (q, k, v, MLP, residual, in the
                             compute dtype) / t + the sampler's max_num_seqs x vocabulary x 4 x 2
    CUDA graphs              1 GB (captured for decode batches up to max_num_seqs; 0 when eager)
    runtime                  1 GB (torch, NCCL)
    KV cache                 what is left: the plan sets it, capped at what max_num_seqs sequences
                             of max_model_len can use; below one max_model_len sequence it does not fit
KV per token: 2 x layers x KV heads x head_dim x compute bytes (147,456 for Qwen3-4B/8B in bf16).
Constants not read from a datasheet are assumptions: the GPU check measures the trainer's peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from april_jax.rollout.cost_model import MODELS, ModelShape, matmul_params
from april_jax.rollout.vllm.server import planned_argv
from april_jax.training.devices import GB, Devices

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
XLA_MARGIN_FRAC, XLA_MARGIN_BYTES = 0.10, 1 * GB
TRAINER_RUNTIME_BYTES = 0.5 * GB
SERVER_RUNTIME_BYTES, CUDA_GRAPH_BYTES = 1 * GB, 1 * GB
OFFLOAD_MODES = ("auto", "on", "off")
CPU_KV_SHARE = 0.25  # a CPU host: the servers' KV caches together take at most this share of its RAM


@dataclasses.dataclass
class ServerPlan:
    name: str
    devices: list[int]  # GPU indices (pinned through the vendor's variable); a CPU host: its cores
    tensor_parallel: int
    kv_cache_bytes: int  # a GPU's (vLLM's --kv-cache-memory-bytes is per GPU)
    kv_tokens: int  # the server's, over its tensor-parallel ranks
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    sleep_level: int  # 0: never sleeps; 1: weights to host and KV dropped through each update
    gpu_memory_utilization: float  # the share of each of its GPUs the server may take (vLLM's start check)
    bytes_per_device: dict[str, int]
    args: list[str]  # the flags the launcher adds to vLLM's own (`vllm.server.VllmServer`)
    env: dict[str, str]
    argv: list[str] = dataclasses.field(default_factory=list)  # the whole command line (port chosen at launch)


@dataclasses.dataclass
class Plan:
    devices: Devices
    deployment: str
    model: dict
    trainer: dict  # devices, mesh, bytes_per_device, env, offload
    rollout: dict  # engine, servers (ServerPlan), sleep_level, memory ("static" / "time_shared" / ...)
    problems: list[str]
    fixes: list[str]  # keys that would make an impossible plan fit

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def servers(self) -> list[ServerPlan]:
        return self.rollout["servers"]

    def to_dict(self) -> dict:
        rollout = dict(self.rollout, servers=[dataclasses.asdict(s) for s in self.servers])
        return {
            "fits": self.fits,
            "problems": list(self.problems),
            "fixes": list(self.fixes),
            "devices": dataclasses.asdict(self.devices) | {"spec": self.devices.describe()},
            "deployment": self.deployment,
            "model": self.model,
            "trainer": self.trainer,
            "rollout": rollout,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def error_line(self) -> str:
        fix = f"; to fit: {'; '.join(self.fixes)}" if self.fixes else ""
        return f"the deployment plan does not fit {self.devices.describe()}: {'; '.join(self.problems)}{fix}"

    def table(self) -> str:
        return render_table(self)

    def summary_line(self, where) -> str:
        """What a run says at startup: the layout in one line, the whole table in `where`."""
        r = self.rollout
        if r["servers"]:
            s = r["servers"][0]
            serving = f"{len(r['servers'])} vLLM server(s) x tensor parallel {s.tensor_parallel}, KV {s.kv_tokens:,} tokens each"
        elif "jax_engine" in r:
            serving = f"JAX engine, {r['jax_engine']['slots']} slots"
        else:
            serving = r["memory"]
        peak = self.trainer["peak_bytes_per_device"] / GB
        return f"deployment plan: {self.devices.describe()}, {self.deployment}: {serving}; trainer {peak:.1f} GB a device ({where})"


# ---- the model's shape ----
def model_shape(c, vocab_size: int | None = None) -> tuple[ModelShape, str]:
    """The policy's shape and where it came from: model.path's config.json; a missing path whose name
    is a preset's (`/ckpt/Qwen3-4B`, to plan before the checkpoint is here); else model.arch."""
    from april_jax.models import qwen3

    path = Path(c.model.path) if c.model.path else None
    if path is not None and (path / "config.json").is_file():
        from april_jax.models.hf import read_config
        from april_jax.runtime.errors import CheckpointError

        cfg = read_config(path)  # a damaged file is its one-line CheckpointError
        cfg = cfg.get("text_config", cfg)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers") if k not in cfg]
        if missing or "num_attention_heads" not in cfg:
            raise CheckpointError(f"{path / 'config.json'}: no {(missing or ['num_attention_heads'])[0]} field")
        heads = cfg["num_attention_heads"]
        shape = ModelShape(
            cfg["vocab_size"],
            cfg["hidden_size"],
            cfg["intermediate_size"],
            cfg["num_hidden_layers"],
            heads,
            cfg.get("num_key_value_heads", heads),
            cfg.get("head_dim") or cfg["hidden_size"] // heads,
            bool(cfg.get("tie_word_embeddings", False)),
        )
        return shape, f"{path}/config.json"
    if path is not None:
        name = path.name.lower()
        preset = next((p for p in sorted(qwen3.PRESETS, key=len, reverse=True) if p in name), None)
        if preset is None:
            raise FileNotFoundError(f"config key 'model.path'={c.model.path!r}: no config.json there to plan from")
        return _preset_shape(preset), f"preset {preset} (model.path is not on this machine)"
    if c.model.arch == "tiny":
        t = c.model.tiny
        shape = ModelShape(
            vocab_size or 1024,
            t.hidden_size,
            t.intermediate_size,
            t.num_hidden_layers,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            True,
        )
        return shape, "model.tiny"
    return _preset_shape(c.model.arch), f"preset {c.model.arch}"


def _preset_shape(name: str) -> ModelShape:
    if name in MODELS:
        return MODELS[name]
    from april_jax.models import qwen3

    p = qwen3.PRESETS[name]
    return ModelShape(
        p.vocab_size,
        p.hidden_size,
        p.intermediate_size,
        p.num_hidden_layers,
        p.num_attention_heads,
        p.num_key_value_heads,
        p.head_dim,
        p.tie_word_embeddings,
    )


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * dtype_bytes


def max_model_len(c) -> int:
    return c.rollout.max_model_len or (c.data.max_prompt_len + c.rollout.max_response_len)


# ---- the trainer ----
def resolve_mesh(axes: dict, devices: int) -> tuple[dict, str | None]:
    """The mesh axes with -1 filled in for `devices`, or a problem naming the keys."""
    axes = {k: int(axes[k]) for k in ("data", "fsdp", "tensor")}
    fixed = math.prod(v for v in axes.values() if v != -1)
    free = [k for k, v in axes.items() if v == -1]
    if free:
        if devices % fixed:
            return axes, f"mesh {axes} does not divide the trainer's {devices} devices (mesh.*)"
        axes[free[0]] = devices // fixed
    if math.prod(axes.values()) != devices:
        return axes, f"mesh {axes} has {math.prod(axes.values())} devices, the trainer {devices} (mesh.*)"
    return axes, None


def flash_attention(c, devices: Devices) -> bool:
    """Whether the train step's attention is cuDNN's fused kernel (no [T, T] scores in memory):
    `model.attention_impl` auto or cudnn, on a GPU, in bf16/fp16 (models/qwen3.py)."""
    return devices.is_gpu and c.model.attention_impl in ("auto", "cudnn") and c.model.compute_dtype != "float32"


def trainer_bytes(c, shape: ModelShape, mesh: dict, logprob_chunk: int, flash: bool = True) -> dict[str, int]:
    """The trainer's bytes on one device by component (the module's docstring says how)."""
    P = matmul_params(shape)[0]
    pb, cb = DTYPE_BYTES[c.model.dtype], DTYPE_BYTES[c.model.compute_dtype]
    shards, tp = mesh["fsdp"] * mesh["tensor"], mesh["tensor"]
    row_shards = mesh["data"] * mesh["fsdp"]
    batch = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    rows = math.ceil((c.train.micro_batch_size or batch) / row_shards)
    T = max_model_len(c)
    h, inter, L, V = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer_params = h * (2 * q + 2 * kv) + 3 * h * inter
    # one layer's activations a token in the forward (q, k, v, attention out, gate, up, act(gate) x up,
    # two norms' fp32 statistics and residuals), its backward as many again
    layer_act = ((2 * q + 2 * kv) + 3 * inter) * cb // tp + 4 * h * 4
    if c.model.remat == "full":
        act = rows * T * (L * h * cb + 2 * layer_act)
    elif c.model.remat == "dots":
        act = rows * T * (L * ((2 * q + 2 * kv + 2 * inter) * cb // tp + h * cb) + 2 * layer_act)
    else:
        act = rows * T * L * 2 * layer_act
    # XLA's attention holds one layer's fp32 scores and probabilities for every head: [T, T] each
    scores = 0 if flash else rows * (shape.num_attention_heads // tp) * T * T * 4 * 2
    chunk = min(logprob_chunk or T, T)
    if c.model.lora_rank:  # a frozen base in the compute dtype; fp32 adapters train, the reference is adapters off
        A = lora_params(c, shape)
        trained = {"parameters": P * cb // shards + A * 4 // shards, "gradients": A * 4 // shards}
        trained.update(optimizer_state=2 * A * 4 // shards, reference=0)
    else:
        trained = {"parameters": P * pb // shards, "gradients": P * pb // shards}
        trained.update(optimizer_state=2 * P * pb // shards, reference=P * pb // shards if c.loss.kl_coef else 0)
    out = {
        **trained,
        "gathered_weights": 2 * (layer_params + V * h) * cb // tp,
        "activations": int(act),
        "attention_scores": int(scores),
        "logprobs": rows * chunk * V * 4 * 3 // tp,
    }
    out["xla_margin"] = int(XLA_MARGIN_FRAC * sum(out.values()) + XLA_MARGIN_BYTES)
    out["runtime"] = int(TRAINER_RUNTIME_BYTES)
    return out


def lora_params(c, shape: ModelShape) -> int:
    """Adapter parameters: rank x (in + out) for every targeted projection of every layer."""
    from april_jax.models.lora import parse_targets

    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    dims = {
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, inter),
        "up": (h, inter),
        "down": (inter, h),
    }
    targets = parse_targets(c.model.lora_targets)
    return shape.num_hidden_layers * sum(c.model.lora_rank * sum(dims[t]) for t in targets)


def _resident_in_rollout(tb: dict[str, int], offload: bool) -> int:
    """What the trainer holds while the engine generates: no gradients or activations; the optimizer
    state unless it went to the host."""
    keep = ("parameters", "reference", "runtime") + (() if offload else ("optimizer_state",))
    return sum(tb[k] for k in keep)


# ---- the servers ----
def server_activation_bytes(shape: ModelShape, cb: int, tp: int, batched_tokens: int, max_num_seqs: int) -> int:
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    per_token = ((2 * q + 2 * kv) + 3 * shape.intermediate_size + 2 * shape.hidden_size) * cb
    return batched_tokens * per_token // tp + max_num_seqs * shape.vocab_size * 4 * 2


def vllm_args(s: ServerPlan) -> list[str]:
    """The flags `VllmServer` adds for this server: what the plan decided, nothing else."""
    args = [
        "--tensor-parallel-size",
        str(s.tensor_parallel),
        "--max-num-batched-tokens",
        str(s.max_num_batched_tokens),
        "--kv-cache-memory-bytes",
        str(s.kv_cache_bytes),
        "--enable-prefix-caching",
    ]
    if s.gpu_memory_utilization:
        args += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:.4f}"]
    if s.enforce_eager:
        args.append("--enforce-eager")
    if s.sleep_level:
        args.append("--enable-sleep-mode")
    return args


def _tensor_parallel_choices(c, shape: ModelShape, n: int) -> list[int]:
    if c.rollout.tensor_parallel:
        return [c.rollout.tensor_parallel]
    # vLLM splits the KV heads over the ranks: a size that divides them and the GPUs
    return [t for t in (1, 2, 4, 8) if t <= n and n % t == 0 and shape.num_key_value_heads % t == 0]


# ---- the plan ----
def make_plan(c, devices: Devices, vocab_size: int | None = None, logprob_chunk: int | None = None) -> Plan:
    """The plan for config `c` on `devices` (problems listed, never raised)."""
    if logprob_chunk is None:
        from april_jax.rl.train_step import LOGPROB_CHUNK as logprob_chunk
    shape, source = model_shape(c, vocab_size)
    P = matmul_params(shape)[0]
    cb = DTYPE_BYTES[c.model.compute_dtype]
    max_len = max_model_len(c)
    model = {
        "shape_from": source,
        "parameters": P,
        "dtype": c.model.dtype,
        "compute_dtype": c.model.compute_dtype,
        "kv_bytes_per_token": kv_bytes_per_token(shape, cb),
        "max_model_len": max_len,
    }
    deployment = c.rollout.deployment
    problems, fixes = [], []
    n = devices.count
    if deployment == "disaggregated" and not devices.is_gpu:
        problems.append(
            "rollout.deployment='disaggregated' needs GPUs (a CPU host serves and trains on the same cores)"
        )
        deployment = "colocated"
    if deployment == "disaggregated":
        serve_n = c.rollout.gpus or n // 2
        if not 0 < serve_n < n:
            problems.append(f"rollout.gpus={serve_n}: disaggregated needs 1..{n - 1} of the {n} GPUs for rollout")
            serve_n = max(1, min(n - 1, serve_n)) if n > 1 else 1
        train_ids, serve_ids = list(range(n - serve_n if n > 1 else n)), list(range(n - serve_n, n))
    else:
        train_ids = serve_ids = list(range(n))
    mesh, mesh_problem = resolve_mesh(c.mesh.to_dict(), len(train_ids))
    if mesh_problem:
        problems.append(mesh_problem)
        mesh = {"data": 1, "fsdp": len(train_ids), "tensor": 1}
    tb = trainer_bytes(c, shape, mesh, logprob_chunk, flash_attention(c, devices))
    trainer_peak = sum(tb.values())
    usable = devices.usable_bytes
    engine = c.rollout.engine
    trainer = {
        "devices": train_ids,
        "mesh": mesh,
        "bytes_per_device": tb,
        "peak_bytes_per_device": trainer_peak,
        "offload": False,
        "env": {},
        "rows_per_device": math.ceil(
            (c.train.micro_batch_size or c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt)
            / (mesh["data"] * mesh["fsdp"])
        ),
    }
    rollout = {"engine": engine, "servers": [], "sleep_level": 0, "memory": "static"}
    plan = Plan(devices, deployment, model, trainer, rollout, problems, fixes)
    if engine == "vllm" and c.rollout.vllm_urls.strip():
        rollout["memory"] = "attached (rollout.vllm_urls: servers started elsewhere)"
        _plan_trainer_env(plan, usable, colocated_server=0)
    elif engine == "vllm":
        _plan_vllm(c, plan, shape, serve_ids, usable)
    elif engine == "jax":
        _plan_jax_engine(c, plan, shape, usable)
    else:
        rollout["memory"] = "simulated (rollout.engine='sim': no model on any device)"
        _plan_trainer_env(plan, usable, colocated_server=0)
    if trainer_peak > usable:
        problems.append(f"the trainer needs {trainer_peak / GB:.1f} GB a device, the device has {usable / GB:.1f} GB")
        fixes.extend(_trainer_fixes(c, tb, mesh, devices))
    plan.fixes = list(dict.fromkeys(fixes))
    return plan


def _trainer_fixes(c, tb: dict, mesh: dict, devices: Devices) -> list[str]:
    out = []
    if c.model.dtype == "float32":
        out.append("model.dtype=bfloat16 (halves parameters, gradients and optimizer state)")
    if c.model.remat != "full":
        out.append("model.remat=full")
    if c.train.micro_batch_size == 0 or c.train.micro_batch_size > mesh["data"] * mesh["fsdp"]:
        out.append("a smaller train.micro_batch_size")
    if c.loss.kl_coef:
        out.append("loss.kl_coef=0 (no reference model)")
    if mesh["data"] > 1:
        out.append("mesh.data=1, mesh.fsdp=-1 (shard the parameters over every device)")
    if devices.count == 1:
        out.append("more devices (--plan-devices 8x...)")
    return out


def _plan_trainer_env(plan: Plan, usable: float, colocated_server: float, time_shared: bool = False) -> None:
    """JAX's allocator, set before its backend starts: a fixed share beside a resident server, the
    platform allocator when the two time-share, JAX's default (75%) when the trainer is alone."""
    if not plan.devices.is_gpu:
        return
    env = plan.trainer["env"]
    if time_shared:
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    elif colocated_server:
        fraction = math.ceil(plan.trainer["peak_bytes_per_device"] / usable * 100) / 100
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="true", XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:.2f}")
    else:
        env.update(XLA_PYTHON_CLIENT_MEM_FRACTION="0.90")


def _plan_vllm(c, plan: Plan, shape: ModelShape, serve_ids: list[int], usable: float) -> None:
    """GPU servers: the smallest tensor-parallel size (the most servers) whose KV cache holds at least
    one max_model_len sequence, beside a resident trainer if it can (colocated 'static'), else
    time-shared with it."""
    devices, rollout, tb = plan.devices, plan.rollout, plan.trainer["bytes_per_device"]
    if not devices.is_gpu:
        _plan_vllm_cpu(c, plan, usable)
        return
    cb = DTYPE_BYTES[c.model.compute_dtype]
    max_len, seqs, kv_tok = plan.model["max_model_len"], c.rollout.max_num_seqs, plan.model["kv_bytes_per_token"]
    colocated = plan.deployment == "colocated"
    modes = (
        ("alone",)
        if not colocated
        else {"auto": ("static", "time_shared"), "on": ("time_shared",)}.get(c.train.offload, ("static", "time_shared"))
    )
    options = []
    for tp in _tensor_parallel_choices(c, shape, len(serve_ids)):
        if len(serve_ids) % tp or shape.num_key_value_heads % tp:
            plan.problems.append(
                f"rollout.tensor_parallel={tp} must divide the {len(serve_ids)} rollout GPUs and the model's "
                f"{shape.num_key_value_heads} KV heads"
            )
            return
        fixed = {
            "weights": plan.model["parameters"] * cb // tp,
            "activations": server_activation_bytes(shape, cb, tp, max_len, seqs),
            "cuda_graphs": 0 if c.rollout.enforce_eager else int(CUDA_GRAPH_BYTES),
            "runtime": int(SERVER_RUNTIME_BYTES),
        }
        for memory in modes:
            offload = memory == "time_shared" and c.train.offload != "off"
            beside = {"static": sum(tb.values()), "time_shared": _resident_in_rollout(tb, offload), "alone": 0}[memory]
            if memory == "time_shared" and sum(tb.values()) + fixed["cuda_graphs"] + fixed["runtime"] > usable:
                continue  # the update does not fit beside the sleeping server either
            room = usable - beside - sum(fixed.values())
            want = c.rollout.kv_cache_bytes or -(-seqs * max_len * kv_tok // tp)  # all slots at full length
            kv = int(max(min(room, want), 0))
            options.append((tp, memory, offload, fixed, kv, kv * tp // kv_tok, beside))
    fitting = [
        o for o in options if o[5] >= max_len and (not c.rollout.kv_cache_bytes or o[4] >= c.rollout.kv_cache_bytes)
    ]
    if not options:
        plan.problems.append("the update does not fit beside a sleeping server on any tensor-parallel size")
        return
    tp, memory, offload, fixed, kv, tokens, beside = fitting[0] if fitting else max(options, key=lambda o: o[5])
    if not fitting:
        if c.rollout.kv_cache_bytes and kv < c.rollout.kv_cache_bytes:
            plan.problems.append(
                f"rollout.kv_cache_bytes={c.rollout.kv_cache_bytes}: only {kv / GB:.2f} GB a GPU is left for KV"
            )
        else:
            plan.problems.append(
                f"a server's KV cache holds {tokens:,} tokens, less than one sequence of prompt + response "
                f"({max_len:,}, rollout.max_model_len)"
            )
        plan.fixes.extend(["a larger rollout.tensor_parallel", "a shorter rollout.max_response_len"])
        if colocated:
            plan.fixes.append("rollout.deployment=disaggregated")
        plan.fixes.extend(_trainer_fixes(c, tb, plan.trainer["mesh"], devices))
    rollout["memory"] = memory
    rollout["sleep_level"] = 1 if memory == "time_shared" else 0
    plan.trainer["offload"] = offload
    server_total = sum(fixed.values()) + kv
    _plan_trainer_env(
        plan, usable, colocated_server=server_total if memory == "static" else 0, time_shared=memory == "time_shared"
    )
    # vLLM's start check wants this share of the GPU free: what the server takes, within what the
    # trainer leaves (its --kv-cache-memory-bytes, not this share, sizes the cache)
    share = max(math.floor(min(server_total / usable + 0.01, 1 - beside / usable - 0.01, 0.95) * 1000) / 1000, 0.0)
    for i in range(len(serve_ids) // tp):
        ids = serve_ids[i * tp : (i + 1) * tp]
        s = ServerPlan(
            name=f"server{i}",
            devices=ids,
            tensor_parallel=tp,
            kv_cache_bytes=kv,
            kv_tokens=tokens,
            max_num_seqs=seqs,
            max_num_batched_tokens=max_len,
            enforce_eager=bool(c.rollout.enforce_eager),
            sleep_level=rollout["sleep_level"],
            gpu_memory_utilization=share,
            bytes_per_device={**fixed, "kv_cache": kv},
            args=[],
            env={devices.visible_env: ",".join(map(str, ids))},
        )
        s.args = vllm_args(s)
        s.argv = planned_argv(c, s, plan.model["max_model_len"], devices.is_gpu)
        rollout["servers"].append(s)


def _plan_vllm_cpu(c, plan: Plan, usable: float) -> None:
    """A CPU host: `rollout.servers` servers (1 by default), each pinned to its own cores, eager; the
    KV caches take what max_num_seqs sequences use, within a share of the host's memory."""
    devices, rollout = plan.devices, plan.rollout
    n = c.rollout.servers or 1
    cores = max(devices.cpu_cores, 1)
    max_len, kv_tok = plan.model["max_model_len"], plan.model["kv_bytes_per_token"]
    want = c.rollout.kv_cache_bytes or max(c.rollout.max_num_seqs * max_len * kv_tok, 32 << 20)
    kv = int(min(want, CPU_KV_SHARE * usable / n))
    if kv // kv_tok < max_len:
        plan.problems.append(
            f"a CPU server's KV cache ({kv / GB:.2f} GB, {CPU_KV_SHARE:.0%} of the host's memory over "
            f"{n} server(s)) holds less than one rollout.max_model_len sequence ({max_len:,} tokens)"
        )
        plan.fixes.extend(["fewer rollout.servers", "a shorter rollout.max_response_len"])
    for i in range(n):
        per = max(cores // n, 1)
        ids = [(i * per + k) % cores for k in range(per)]
        # one server: vLLM's own binding, which keeps a core for its frontend (on 2 cores a worker
        # spread over both ran 3x slower: ../shared/notes/vllm-cpu.md); several: a share each
        bind = {} if n == 1 else {"VLLM_CPU_OMP_THREADS_BIND": _core_list(ids)}
        if n == 1:
            ids = list(range(max(cores - 1, 1)))
        s = ServerPlan(
            name=f"server{i}",
            devices=ids,
            tensor_parallel=1,
            kv_cache_bytes=kv,
            kv_tokens=kv // kv_tok,
            max_num_seqs=c.rollout.max_num_seqs,
            max_num_batched_tokens=max(max_len, c.rollout.max_num_seqs),
            enforce_eager=True,
            sleep_level=0,
            gpu_memory_utilization=0.0,
            bytes_per_device={"kv_cache": kv},
            args=[],
            env=bind,
        )
        s.args = vllm_args(s)
        s.argv = planned_argv(c, s, plan.model["max_model_len"], devices.is_gpu)
        rollout["servers"].append(s)
    rollout["memory"] = "cpu"


def _core_list(ids: list[int]) -> str:
    return (
        f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))
    )


def _plan_jax_engine(c, plan: Plan, shape: ModelShape, usable: float) -> None:
    """The embedded engine shares the trainer's devices and JAX's memory pool. Per device it holds:
    its contiguous cache (slots x max_model_len positions; the slots split over the mesh's data x
    fsdp when they divide it, else every device holds all of them; the KV heads over tensor when
    they divide it; fp32 on a CPU host, `default_cache_dtype`), as much again with
    rollout.reuse_aborted_kv (the side cache), and the working set of one device call: the rows a
    decode, extend, prompt copy or prefill gathers (at most every slot at max_model_len) held
    about twice, whole on every device of a mesh (a gather over the sharded slots is not sharded:
    XLA's memory_analysis of the engine's programs on 8 CPU devices gave 1.3-2x the gathered rows a
    device, on one device 1.1-1.8x): an upper bound. Beside them: the trainer's resident state (the
    optimizer state on the host when offloaded), its XLA margin and gathered weights; the whole
    update too when the cache is kept through it (rollout.free_kv_cache_in_train=false); a copy of
    the weights when the engine runs on rollout.engine_devices of the devices."""
    tb, rollout, devices = plan.trainer["bytes_per_device"], plan.rollout, plan.devices
    _plan_trainer_env(plan, usable, colocated_server=0)
    own_mesh = _engine_mesh(c, plan)  # None: the engine reads the trainer's arrays on its mesh
    max_len, mesh = plan.model["max_model_len"], own_mesh or plan.trainer["mesh"]
    slot_shards = mesh["data"] * mesh["fsdp"]
    # a slot's row on one device: its KV heads split over tensor when they divide it
    row = (
        max_len * plan.model["kv_bytes_per_token"] * (1 if devices.is_gpu else 4 // DTYPE_BYTES[c.model.compute_dtype])
    )
    row //= mesh["tensor"] if shape.num_key_value_heads % mesh["tensor"] == 0 else 1
    caches = 2 if c.rollout.reuse_aborted_kv else 1
    working = lambda slots: 2 * slots * row
    cache = lambda slots: caches * row * (slots // slot_shards if slots % slot_shards == 0 else slots)
    need = lambda slots: cache(slots) + working(slots)
    pool = usable
    if devices.is_gpu:  # JAX allocates from its pool, a fraction of the device (the plan's env)
        pool = min(usable, float(plan.trainer["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * devices.bytes_per_device)
    weights = (
        0
        if own_mesh is None
        else plan.model["parameters"] * DTYPE_BYTES[c.model.dtype] // (mesh["fsdp"] * mesh["tensor"])
    )

    def room(offload: bool) -> float:
        beside = _resident_in_rollout(tb, offload) + tb["xla_margin"] + tb["gathered_weights"] + weights
        if not c.rollout.free_kv_cache_in_train:  # the cache stays through the update (state back on the device)
            beside = max(beside, sum(tb.values()) + weights)
        return max(pool - beside, 0.0)

    offload = c.train.offload == "on"
    fit = _slots_that_fit(need, room(offload), slot_shards)
    if fit < c.rollout.max_num_seqs and c.train.offload == "auto" and c.rollout.free_kv_cache_in_train:
        offload = True
        fit = _slots_that_fit(need, room(offload), slot_shards)
    slots = c.rollout.max_num_seqs if need(c.rollout.max_num_seqs) <= room(offload) else fit
    rollout["memory"] = "in-process (JAX's pool; " + (
        "KV freed through the update)" if c.rollout.free_kv_cache_in_train else "KV kept through the update)"
    )
    rollout["jax_engine"] = {
        "slots": slots,
        "slots_that_fit": fit,
        "slot_shards": slot_shards,
        "kv_cache_bytes_per_device": cache(slots),
        "working_set_bytes_per_device": working(slots),
        "kv_tokens": slots * max_len,
    }
    plan.trainer["offload"] = offload
    if slots < c.rollout.max_num_seqs:
        plan.problems.append(
            f"rollout.max_num_seqs={c.rollout.max_num_seqs}: the JAX engine's cache of {c.rollout.max_num_seqs} x "
            f"{max_len:,} positions and a device call's working set need "
            f"{need(c.rollout.max_num_seqs) / GB:.1f} GB a device, {room(offload) / GB:.1f} GB are left: "
            f"set rollout.max_num_seqs<={fit}"
        )
        plan.fixes.append(f"rollout.max_num_seqs={fit}" if fit else "a shorter rollout.max_response_len")
        plan.fixes.append("rollout.engine=vllm (a paged KV cache)")


def _engine_mesh(c, plan: Plan) -> dict | None:
    """The mesh axes of a JAX engine on rollout.engine_devices of the GPUs (its own copy of the
    weights): the run's axes if they fit, else all on fsdp (`distributed.engine_mesh`); None when
    it runs on all of them (a CPU host is one device here, and a count past the GPUs the run
    itself refuses)."""
    n = c.rollout.engine_devices
    if not plan.devices.is_gpu or not n or n >= len(plan.trainer["devices"]):
        return None
    mesh, problem = resolve_mesh(c.mesh.to_dict(), n)
    return {"data": 1, "fsdp": n, "tensor": 1} if problem else mesh


def _slots_that_fit(need, room: float, step: int) -> int:
    """The most slots, a multiple of `step` (the cache's slots split over `step` devices), whose
    `need(slots)` bytes fit `room` (need grows with the slots)."""
    lo, hi = 0, 1
    while need(hi * step) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid * step) <= room else (lo, mid)
    return lo * step


# ---- the table ----
def _gb(x: float) -> str:
    return f"{x / GB:7.2f} GB"


def render_table(plan: Plan) -> str:
    t = plan.trainer
    lines = [
        f"deployment plan: {plan.devices.describe()}, rollout.deployment={plan.deployment}, "
        f"rollout.engine={plan.rollout['engine']}",
        f"model: {plan.model['parameters'] / 1e9:.2f}B parameters ({plan.model['shape_from']}), "
        f"{plan.model['dtype']} weights, {plan.model['compute_dtype']} compute, "
        f"KV {plan.model['kv_bytes_per_token']:,} bytes a token, max_model_len {plan.model['max_model_len']:,}",
        f"trainer: devices {_ids(t['devices'])}, mesh {t['mesh']}, {t['rows_per_device']} row(s) a device a micro-batch"
        + (", optimizer state on the host during rollout" if t["offload"] else ""),
    ]
    for k, v in t["bytes_per_device"].items():
        lines.append(f"  {k:<22}{_gb(v)}")
    lines.append(f"  {'peak a device':<22}{_gb(t['peak_bytes_per_device'])}")
    if t["env"]:
        lines.append("  env " + " ".join(f"{k}={v}" for k, v in t["env"].items()))
    r = plan.rollout
    lines.append(f"rollout: {r['memory']}" + (f", sleep level {r['sleep_level']}" if r["servers"] else ""))
    for s in r["servers"]:
        what = "cores" if not plan.devices.is_gpu else "GPUs"
        lines.append(
            f"  {s.name}: {what} {_ids(s.devices)}, tensor parallel {s.tensor_parallel}, KV {s.kv_tokens:,} tokens "
            f"({s.kv_cache_bytes / GB:.2f} GB), max_num_seqs {s.max_num_seqs}"
            + (", eager" if s.enforce_eager else ", CUDA graphs")
            + "; "
            + " ".join(f"{k}={v}" for k, v in s.env.items())
        )
    if r["servers"] and plan.devices.is_gpu:
        for k, v in r["servers"][0].bytes_per_device.items():
            lines.append(f"  {k:<22}{_gb(v)}  (a GPU of each server)")
        lines.append("  " + " ".join(r["servers"][0].argv or r["servers"][0].args))
    if "jax_engine" in r:
        j = r["jax_engine"]
        lines.append(
            f"  JAX engine: {j['slots']} slots x {plan.model['max_model_len']:,} positions, "
            f"{j['kv_cache_bytes_per_device'] / GB:.2f} GB a device ({j['slots_that_fit']} would fit)"
        )
    lines.append("fits" if plan.fits else "does not fit: " + "; ".join(plan.problems))
    if plan.fixes:
        lines.append("to fit: " + "; ".join(plan.fixes))
    return "\n".join(lines)


def _ids(ids: list[int]) -> str:
    return (
        f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))
    )


def print_plan(plan: Plan, as_json: bool, file=sys.stdout) -> None:
    print(plan.to_json() if as_json else plan.table(), file=file)


def plan_for_run(c, vocab_size: int | None = None, log=None) -> Plan:
    """This host's plan for a run, before JAX's backend starts: an impossible plan is a ConfigError
    (one line naming the keys that would make it fit); the trainer's allocator variables are set
    unless the environment already sets them (then the environment wins, and `log` says so)."""
    import os

    from april_jax.config.schema import ConfigError
    from april_jax.training.devices import local_devices

    try:
        plan = make_plan(c, local_devices(), vocab_size)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if not plan.fits:
        raise ConfigError(plan.error_line())
    for name, value in plan.trainer["env"].items():
        if os.environ.get(name, value) != value and log is not None:
            log(f"deployment plan: {name}={os.environ[name]} from the environment (the plan's: {value})")
        os.environ.setdefault(name, value)
    return plan


def write_plan(plan: Plan, workdir: Path) -> None:
    (workdir / "plan.json").write_text(plan.to_json() + "\n")
    (workdir / "plan.txt").write_text(plan.table() + "\n")
