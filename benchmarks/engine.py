"""Decode tokens/s of the embedded JAX engine vs transformers `generate` on the same weights.

    python -m benchmarks.engine [--batches 1,16,64] [--new-tokens 128] [--prompt-len 32] [--dtype bfloat16]
                                [--busy 4/128]
                                [--vllm-python ../.venv-vllm/bin/python]

Both generate greedily, exactly `new_tokens` per request, from the same random ~40M-parameter
checkpoint (fp32). The engine runs with `max_num_seqs = batch`; its figure includes the prefills,
its host loop and stop checks (everything a rollout pays); a warm-up run first compiles.
`busy_step`: a decode step with 4 of 128 slots busy against one with all 128 busy, at the same
context (prompt-len + new-tokens); with compaction off for comparison (every slot, the whole row).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from april_jax.models import hf, qwen3
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from benchmarks.common import CONFIG_40M, timed


def timed_generate(engine, prompts, new_tokens):
    """(tokens/s, results) of one greedy batch, after a warm-up batch that compiles / warms caches."""
    greedy = SamplingParams(temperature=0.0)
    requests = lambda tag: [Request(f"{tag}{i}", p, new_tokens, greedy) for i, p in enumerate(prompts)]
    engine.generate(requests("warm"))
    t = time.perf_counter()
    out = engine.generate(requests("run"))
    elapsed = time.perf_counter() - t
    return sum(len(r.token_ids) for r in out.values()) / elapsed, out


def engine_tokens_per_s(model, prompts, new_tokens, max_len, steps_per_call):
    engine = JaxEngine(model, max_num_seqs=len(prompts), max_model_len=max_len, decode_steps_per_call=steps_per_call)
    return timed_generate(engine, prompts, new_tokens)


def decode_step_seconds(model, slots, busy, context, compact=True, steps=16):
    """Seconds per decode step with `busy` of `slots` slots running at `context` positions (after
    a first step that prefills and compiles): the engine's time in `step()` over the steps it ran."""
    engine = JaxEngine(
        model, max_num_seqs=slots, max_model_len=context + steps + 16, decode_steps_per_call=8, compact_decode=compact
    )
    rng = np.random.RandomState(1)
    engine.submit(
        [
            Request(
                str(i),
                rng.randint(1, CONFIG_40M.vocab_size, context).tolist(),
                steps + 16,
                SamplingParams(temperature=0.0),
            )
            for i in range(busy)
        ]
    )
    engine.step()  # prefill + the first decode call (compiles)
    s0, t = engine.stats().decode_steps, time.perf_counter()
    while engine.stats().decode_steps - s0 < steps:
        engine.step()
    return (time.perf_counter() - t) / (engine.stats().decode_steps - s0)


def busy_step_costs(model, slots, busy, context):
    """A decode step with `busy` of `slots` slots busy against one with every slot busy, same context;
    the same with compaction off (every slot and the whole row computed)."""
    few, full = decode_step_seconds(model, slots, busy, context), decode_step_seconds(model, slots, slots, context)
    few_uncompacted = decode_step_seconds(model, slots, busy, context, compact=False)
    return {
        "slots": slots,
        "busy": busy,
        "context": context,
        "busy_step_ms": round(1e3 * few, 2),
        "full_step_ms": round(1e3 * full, 2),
        "busy_over_full": round(few / full, 3),
        "busy_step_without_compaction_ms": round(1e3 * few_uncompacted, 2),
        "without_compaction_over_full": round(few_uncompacted / full, 3),
    }


def forward_floor_tokens_per_s(model, batch):
    """Batch / seconds of one jitted single-token forward with no KV cache: every weight matmul of a
    decode step, no attention over context, no sampling. No decode step can beat it."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    seconds, _ = timed(step, state, jnp.zeros((batch, 1), jnp.int32), repeats=10)
    return batch / seconds


def hf_tokens_per_s(ref, prompts, new_tokens):
    ids = torch.tensor(prompts)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        ref.generate(
            ids[:, :8],
            **{**kw, "attention_mask": torch.ones_like(ids[:, :8]), "max_new_tokens": 4, "min_new_tokens": 4},
        )
        t = time.perf_counter()
        out = ref.generate(ids, **kw)
        elapsed = time.perf_counter() - t
    return len(prompts) * new_tokens / elapsed, out[:, ids.shape[1] :].numpy()


def vllm_tokens_per_s(path, python, prompts, new_tokens, max_len):
    from april_jax.rollout.vllm.engine import VllmEngine

    engine = VllmEngine(path, python=python, max_num_seqs=len(prompts), max_model_len=max_len)
    try:
        return timed_generate(engine, prompts, new_tokens)
    finally:
        engine.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-steps-per-call", type=int, default=8)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and compute of both the JAX model and transformers",
    )
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm: also measure a vLLM server")
    parser.add_argument(
        "--busy",
        default="4/128",
        help="BUSY/SLOTS: a decode step with BUSY of SLOTS slots busy vs "
        "all busy, at context prompt-len + new-tokens ('' skips)",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows = []
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = tmp_dir.name
    hf.save_pretrained(qwen3.init_model(CONFIG_40M, seed=0), tmp)
    model = hf.from_pretrained(tmp, dtype=qwen3.as_dtype(args.dtype))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, args.dtype)).eval()
    rng = np.random.RandomState(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: rng.randint(1, CONFIG_40M.vocab_size, size=(b, args.prompt_len)).tolist() for b in batches}
    # All engine runs first, then all transformers runs: torch's OpenMP threads keep spinning for a
    # while after each call and would steal the 2 cores from XLA if interleaved.
    ours = {
        b: engine_tokens_per_s(
            model, prompts[b], args.new_tokens, args.prompt_len + args.new_tokens + 16, args.decode_steps_per_call
        )
        for b in batches
    }
    floor = {b: forward_floor_tokens_per_s(model, b) for b in batches}
    busy = None
    if args.busy:
        few, slots = map(int, args.busy.split("/"))
        busy = busy_step_costs(model, slots, few, args.prompt_len + args.new_tokens)
    vllm = {}
    if args.vllm_python:  # before torch runs here: its OpenMP threads would spin on our cores
        vllm = {
            b: vllm_tokens_per_s(
                tmp, args.vllm_python, prompts[b], args.new_tokens, args.prompt_len + args.new_tokens + 16
            )
            for b in batches
        }
    for b in batches:
        theirs, hf_out = hf_tokens_per_s(ref, prompts[b], args.new_tokens)
        rate, out = ours[b]
        same = float(np.mean([out[f"run{i}"].token_ids == hf_out[i].tolist() for i in range(b)]))
        row = {
            "batch": b,
            "jax_engine_tokens_per_s": round(rate, 1),
            "hf_generate_tokens_per_s": round(theirs, 1),
            "ratio": round(rate / theirs, 2),
            "greedy_identical_frac": same,
            "jax_forward_floor_tokens_per_s": round(floor[b], 1),
        }
        if b in vllm:
            v_rate, v_out = vllm[b]
            row["vllm_tokens_per_s"] = round(v_rate, 1)
            row["jax_over_vllm"] = round(rate / v_rate, 2)
            row["vllm_greedy_identical_frac"] = float(
                np.mean([v_out[f"run{i}"].token_ids == out[f"run{i}"].token_ids for i in range(b)])
            )
        rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "engine",
                "params_m": round(CONFIG_40M.num_params / 1e6, 1),
                "dtype": args.dtype,
                "new_tokens": args.new_tokens,
                "prompt_len": args.prompt_len,
                "torch_threads": torch.get_num_threads(),
                "decode_steps_per_call": args.decode_steps_per_call,
                "busy_step": busy,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
