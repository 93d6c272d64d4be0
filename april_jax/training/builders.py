"""What a run builds from its config: the policy model, the frozen KL reference and the rollout
engine, plus the vocabulary check that runs before any of them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from april_jax.config import ConfigError
from april_jax.config.keys import vllm_url_list
from april_jax.rollout.engine import EngineProtocol
from april_jax.runtime import distributed


def check_vocab(c, task_vocab: int | None) -> None:
    """Token ids past the model's embedding would be clamped silently: compare the sizes up front."""
    from april_jax.models import qwen3

    if task_vocab is None or (not c.model.path and c.model.arch == "tiny"):
        return  # the tiny model is sized to the task's vocabulary
    if c.model.path:
        from april_jax.models.hf import read_config

        model_vocab, what = read_config(c.model.path).get("vocab_size"), f"model.path={c.model.path}"
    elif c.model.arch in qwen3.PRESETS:
        model_vocab, what = qwen3.PRESETS[c.model.arch].vocab_size, f"model.arch={c.model.arch}"
    else:
        return  # build_model names the bad arch
    if model_vocab is not None and task_vocab > int(model_vocab):
        source = c.data.tokenizer_path or c.model.path or "the task"
        raise ConfigError(
            f"the tokenizer ({source}) has {task_vocab} tokens but the model ({what}) only "
            f"{model_vocab}: set data.tokenizer_path to the model's tokenizer"
        )


def build_model(c, mesh, vocab_size):
    from april_jax.models import hf, qwen3

    dtype = qwen3.as_dtype(c.model.dtype)
    compute = qwen3.as_dtype(c.model.compute_dtype)
    choices = dict(remat=c.model.remat, attention_impl=c.model.attention_impl)
    if c.model.path:
        return hf.from_pretrained(c.model.path, dtype=dtype, compute_dtype=compute, mesh=mesh, **choices)
    if c.model.arch == "tiny":
        cfg = qwen3.Qwen3Config(
            vocab_size=vocab_size or 1024,
            param_dtype=dtype,
            dtype=compute,
            max_position_embeddings=4096,
            **choices,
            **c.model.tiny.to_dict(),
        )
    elif c.model.arch in qwen3.PRESETS:
        cfg = qwen3.PRESETS[c.model.arch].replace(param_dtype=dtype, dtype=compute, **choices)
    else:
        raise ConfigError(
            f"config key 'model.arch'={c.model.arch!r}: expected 'tiny' or one of {sorted(qwen3.PRESETS)}"
        )
    return qwen3.init_model(cfg, seed=c.seed, mesh=mesh)


def build_reference(c, mesh, model, workdir: Path, fresh: bool):
    """The frozen KL reference, or None (no KL, or the Trainer copies the initial params).

    loss.ref_path if set; else the initial policy. After a supervised warm-up the initial policy
    cannot be rebuilt from the config on resume, so a fresh run saves it to WORKDIR/reference.
    """
    from april_jax.models import hf, qwen3

    if not c.loss.kl_coef or (c.model.lora_rank and not c.loss.ref_path):
        return None  # with LoRA the reference is the policy's own base, adapters off
    path = c.loss.ref_path
    if not path and c.warmup.steps:
        path = str(workdir / "reference")
        if fresh:
            distributed.save_pretrained(model, path)
            return None
    if not path:
        return None
    return hf.from_pretrained(
        path,
        dtype=qwen3.as_dtype(c.model.dtype),
        mesh=mesh,
        compute_dtype=qwen3.as_dtype(c.model.compute_dtype),
        remat=c.model.remat,
        attention_impl=c.model.attention_impl,
    )


def build_lora(c, mesh, model, workdir: Path, fresh: bool):
    """The run's LoRAConfig (None: full fine-tuning), with the fingerprint of its frozen base.

    The base is model.path, or the random model of the seed; after a supervised warm-up it cannot
    be rebuilt from the config, so a fresh run saves it to WORKDIR/lora_base and a resumed one
    loads it back into `model` (in place)."""
    from april_jax import config as config_lib
    from april_jax.models import hf, lora, qwen3

    if not c.model.lora_rank:
        return None
    config = json.loads(c.to_json())
    kind, where = lora.base_source(config)
    if kind == "path" and not c.model.path:
        if fresh:
            distributed.save_pretrained(model, where)
        else:
            from flax import nnx

            saved = hf.from_pretrained(
                where,
                dtype=qwen3.as_dtype(c.model.dtype),
                mesh=mesh,
                compute_dtype=qwen3.as_dtype(c.model.compute_dtype),
            )
            nnx.update(model, nnx.state(saved, nnx.Param))
    lora_cfg = config_lib.lora_cfg(c, base=lora.base_fingerprint(config))
    try:
        lora.check_rank(model.cfg, lora_cfg)
    except ValueError as e:
        raise ConfigError(f"config key 'model.lora_rank'={c.model.lora_rank}: {e}") from None
    return lora_cfg


def build_engine(c, model, max_model_len: int, version: int, plan=None) -> EngineProtocol:
    """The run's rollout engine, as the deployment plan (`training/plan.py`) lays it out."""
    if c.rollout.engine == "jax":
        from april_jax.rollout.jax_engine import JaxEngine

        return JaxEngine(
            model,
            max_num_seqs=c.rollout.max_num_seqs,
            max_model_len=max_model_len,
            seed=c.seed,
            policy_version=version,
            decode_steps_per_call=c.rollout.decode_steps_per_call,
            reuse_aborted_kv=c.rollout.reuse_aborted_kv,
            samples_per_prompt=c.rollout.n_samples_per_prompt,
            free_kv_in_sleep=c.rollout.free_kv_cache_in_train,
            merge_padding_tokens=c.rollout.merge_padding_tokens,
            hold_aborted_kv=c.rollout.hold_aborted_kv and not c.rollout.reuse_aborted_kv,  # the side cache instead
            smallest_prefill_bucket=c.rollout.smallest_prefill_bucket,
        )
    if c.rollout.engine == "sim":
        from april_jax.rollout.sim_engine import SimEngine

        return SimEngine(
            slots=c.rollout.max_num_seqs,
            seed=c.seed,
            max_model_len=max_model_len,
            length_scale=c.rollout.max_response_len / 32768,
            policy_version=version,
        )
    return _build_vllm_engine(c, model, max_model_len, version, plan)


def check_vllm_attach(c) -> None:
    """Servers to attach to (rollout.vllm_urls), checked before the run writes its workdir: the URLs'
    form, the transport folder, each server's /health and its acceptance of $VLLM_API_KEY. Bad input
    then leaves nothing behind; the engine checks the same again when it attaches."""
    if c.rollout.engine != "vllm" or not distributed.is_main():
        return
    urls = vllm_url_list(c.rollout.vllm_urls)
    if not urls:
        return
    from april_jax.rollout.vllm.engine import check_attached
    from april_jax.rollout.vllm.server import VllmSetupError

    try:
        check_attached(urls, os.environ.get("VLLM_API_KEY"))
    except VllmSetupError as e:
        raise ConfigError(f"rollout.vllm_urls: {e}") from None


def _build_vllm_engine(c, model, max_model_len: int, version: int, plan=None) -> EngineProtocol:
    """Attached to rollout.vllm_urls, or launching the plan's servers (one default server without a
    plan) from the trainer's current weights."""
    from april_jax.rollout.vllm.engine import VllmEngine
    from april_jax.rollout.vllm.server import VllmSetupError, find_vllm_python, prepare_model_dir, vllm_init_dir

    urls = vllm_url_list(c.rollout.vllm_urls)
    level = _sleep_level(c, plan)
    common = dict(
        max_num_seqs=c.rollout.max_num_seqs,
        max_model_len=max_model_len,
        policy_version=version,
        weight_transport=c.rollout.weight_transport,
        sleep_mode=level > 0,
        sleep_level=max(level, 1),
        keep_prefix_cache_versions=kept_prefix_cache_versions(c, sleeping=level > 0),
    )
    try:
        if urls:
            return VllmEngine(urls=urls, api_key=os.environ.get("VLLM_API_KEY"), **common)
        python = find_vllm_python(c.rollout.vllm_python or None, gpu_vendor=_serving_gpu_vendor(plan))
    except VllmSetupError as e:
        raise ConfigError(f"rollout.vllm_urls: {e}" if urls else str(e)) from None
    # the servers start from the trainer's current weights, with the run's tokenizer
    init_dir = prepare_model_dir(model, vllm_init_dir(c.workdir), c.data.tokenizer_path or c.model.path or None)
    return VllmEngine(
        init_dir,
        python=python,
        log_dir=c.workdir,
        dtype=c.model.compute_dtype,
        servers=plan.servers if plan is not None and plan.servers else None,
        **common,
    )


def _serving_gpu_vendor(plan) -> str | None:
    """The vendor of the GPUs the plan's servers run on; None on a CPU host (or without a plan)."""
    return plan.devices.vendor if plan is not None and plan.devices.is_gpu and plan.servers else None


def _sleep_level(c, plan) -> int:
    """The servers' sleep level through the update: on GPUs the plan's (a server time-shared with the
    trainer sleeps, one beside it keeps its KV cache); elsewhere, or attached to servers started
    elsewhere, rollout.vllm_sleep_mode (level 1)."""
    if plan is not None and plan.devices.is_gpu and plan.servers:
        return plan.rollout["sleep_level"]
    return 1 if c.rollout.vllm_sleep_mode else 0


def kept_prefix_cache_versions(c, sleeping: bool | None = None) -> int:
    """Weight syncs a vLLM server's prefix cache lives through: APRIL's resumed responses find their
    prompt and partial tokens there (hold_aborted_kv), no older than a response may be (max_staleness).
    A sleeping server (`sleeping`, default rollout.vllm_sleep_mode) drops its KV at every update."""
    sleeping = c.rollout.vllm_sleep_mode if sleeping is None else sleeping
    keep = c.rollout.partial_rollout and c.rollout.hold_aborted_kv and not sleeping
    return c.rollout.max_staleness if keep else 0
