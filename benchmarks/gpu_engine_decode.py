"""Decode tokens/s of the embedded JAX engine against the memory roofline.

    python -m benchmarks.gpu_engine_decode [--model qwen3-0.6b] [--batches 16,64,256] [--prompt-len 128]
                                           [--short 65] [--long 257] [--dry-run]

A random-init model in bf16 (weights and KV cache), `JaxEngine(max_num_seqs=batch,
max_model_len=prompt_len + long)`, every slot busy, sampling at temperature 0.8 (the recipes'),
no stop tokens. Decode-only rate by difference: the same batch runs `short` and `long` new tokens
(after a warm-up that compiles), so prefill, first calls and per-run overheads cancel:
tokens/s = batch * (long - short) / (t_long - t_short). With 8 decode steps per call, long - 1
and short - 1 multiples of 8 keep every call a full one; the warm-up compiles every cache-length
bucket the timed runs use.

Roofline (a decode step must read every weight and the KV of every live token once):
tokens/s = batch * HBM bandwidth / (weight bytes + batch * context * KV bytes per token), context
the mean over the measured steps (prompt + (short + long) / 2). HBM bandwidth: the spec-sheet
figure (H200: 4.8 TB/s, `gpu_common.HBM_BYTES_PER_S`); the measured copy bandwidth of the same
run is reported beside it. `cache_roofline_tokens_per_s` charges every row all max_model_len
positions instead: the most the decode can read (it reads up to its cache-length bucket).
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np
from flax import nnx

from april_jax.models import qwen3
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from benchmarks.gpu_common import copy_bandwidth_bytes_per_s, device_info, emit, model_config, spec_hbm_bytes_per_s

GOAL_FRACTION_AT_64 = 0.60  # the goal on an H200: >= 60% of the roofline at batch 64


def weight_bytes_read_per_step(model: qwen3.Qwen3) -> int:
    """Every parameter once; an untied embedding table is only gathered (B rows), so it is left out."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return total - (0 if model.cfg.tie_word_embeddings else model.embed_tokens[...].nbytes)


def measure(model, batch: int, args, bandwidth: float) -> dict:
    cfg = model.cfg
    max_len = args.prompt_len + args.long
    engine = JaxEngine(model, max_num_seqs=batch, max_model_len=max_len, decode_steps_per_call=args.steps_per_call)
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).tolist()

    def run(new_tokens: int, tag: str) -> float:
        requests = [
            Request(f"{tag}{i}", p, new_tokens, SamplingParams(temperature=args.temperature, seed=i))
            for i, p in enumerate(prompts)
        ]
        t = time.perf_counter()
        out = engine.generate(requests)
        seconds = time.perf_counter() - t
        lengths = {len(r.token_ids) for r in out.values()}
        if lengths != {new_tokens} or len(out) != batch:
            raise RuntimeError(f"batch {batch}: expected {batch} x {new_tokens} tokens, got lengths {sorted(lengths)}")
        return seconds

    t = time.perf_counter()
    run(args.long, "warm")
    warm_s = time.perf_counter() - t
    # the fastest of `repeats` runs each: on a small model the two differ by a few calls, so noise
    # could otherwise swallow the difference
    t_short = min(run(args.short, f"short{k}.") for k in range(args.repeats))
    t_long = min(run(args.long, f"long{k}.") for k in range(args.repeats))
    stats = engine.stats()
    engine.shutdown()
    decode_tps = batch * (args.long - args.short) / (t_long - t_short)
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(engine._cache_dtype).itemsize
    )
    context = args.prompt_len + (args.short + args.long) / 2
    w_bytes = weight_bytes_read_per_step(model)
    roofline = batch * bandwidth / (w_bytes + batch * context * kv_per_token)
    cache_roofline = batch * bandwidth / (w_bytes + batch * max_len * kv_per_token)
    return {
        "batch": batch,
        "decode_tokens_per_s": round(decode_tps, 1),
        "roofline_tokens_per_s": round(roofline, 1),
        "fraction_of_roofline": round(decode_tps / roofline, 4),
        "cache_roofline_tokens_per_s": round(cache_roofline, 1),
        "fraction_of_cache_roofline": round(decode_tps / cache_roofline, 4),
        "step_ms": round(1e3 * batch / decode_tps, 3),
        "weight_bytes": w_bytes,
        "kv_bytes_per_token": kv_per_token,
        "mean_context": context,
        "max_model_len": max_len,
        "cache_dtype": str(np.dtype(engine._cache_dtype)),
        "t_short_s": round(t_short, 4),
        "t_long_s": round(t_long, 4),
        "warmup_s": round(warm_s, 2),
        "decode_calls": stats.decode_calls,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short", type=int, default=65)
    parser.add_argument("--long", type=int, default=257)
    parser.add_argument("--steps-per-call", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=1, help="time the short and the long run this many times each")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: the same code in seconds on CPU")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.batches, args.prompt_len, args.short, args.long = "tiny", "4", 16, 9, 57
        args.repeats = 3
    info = device_info()
    spec = spec_hbm_bytes_per_s()
    measured = copy_bandwidth_bytes_per_s(2**31 if info["backend"] == "gpu" else 2**26)
    bandwidth = spec or measured
    cfg = model_config(args.model).replace(param_dtype="bfloat16", dtype="bfloat16")
    model = qwen3.init_model(cfg, seed=0)
    for batch in (int(b) for b in args.batches.split(",")):
        row = {
            "benchmark": "gpu_engine_decode",
            **info,
            "model": args.model,
            "params_m": round(cfg.num_params / 1e6, 1),
            "dtype": "bfloat16",
            "prompt_len": args.prompt_len,
            "short": args.short,
            "long": args.long,
            "temperature": args.temperature,
            "steps_per_call": args.steps_per_call,
            "hbm_bytes_per_s_used": round(bandwidth, 1),
            "hbm_bandwidth_source": "spec sheet" if spec else "measured copy",
            "measured_copy_bytes_per_s": round(measured, 1),
            "goal_fraction_at_64": GOAL_FRACTION_AT_64,
        }
        try:
            row.update(measure(model, batch, args, bandwidth))
        except Exception as e:
            row.update({"batch": batch, "error": f"{type(e).__name__}: {str(e)[:800]}"})
        emit(row)
        gc.collect()


if __name__ == "__main__":
    main()
