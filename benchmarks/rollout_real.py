"""APRIL against synchronous rollout on a real checkpoint and real prompts, on a real engine.

    python -m benchmarks.rollout --engine jax  --model asset:smollm2-135m-instruct [--seed 0]
    python -m benchmarks.rollout --engine vllm --model asset:smollm2-135m-instruct [--seed 0]

The model's own response lengths: every response runs until the model stops (its EOS or
end-of-turn token) or reaches `--max-response-len`; nothing shapes them. The prompts are the
GSM8K-style problems shipped as an asset (`--prompts`, default asset:gsm-symbolic-train), in the
checkpoint's chat template, in the order a training run with this seed draws them. `--engine jax`
is the embedded engine (`JaxEngine`, the programs compiled up front); `--engine vllm` launches a
vLLM server from the checkpoint with the interpreter of `.venv-vllm` (`VllmEngine`). One engine
serves both modes, one after the other (sync first), from the same prompts.

APRIL is the product's defaults (`RolloutConfig()`, partial_rollout on); the sync baseline is
over_sampling_batch_size = rollout_batch_size, partial_rollout off. After every step the policy
version goes up by one through `update_weights` with the model's own (unchanged) weights, so the
versions, staleness and, on vLLM, the weight transfer are those of training; nothing trains.

Figures (per mode, over the steps after `--warmup-steps`; the warm-up steps are reported apart):
- delivered tokens/s: response tokens of the groups handed to training over the time of those
  steps (rollout and weight syncs) less their JAX compile seconds (`compile_clock`: the extend
  programs of APRIL's first resumes compile when first met; a training run pays that once, not
  every few steps); tokens still in APRIL's buffer at the end do not count. `delivered_speedup` is
  APRIL's over sync's, `delivered_speedup_with_compiles` the same with the compiles left in;
- delivered response lengths (mean, p50, p90, max), dropped tokens (every step), the off-policy
  token fraction (tokens of an older version than their step's), prefill tokens, and where the
  time went (`time_split_s`: engine steps, JAX's apart when they prefilled, weight syncs, the rest);
- `step_cost`: ms per engine step at each number of running requests seen, and `ceiling`, the most
  tokens/s those costs allow (`step_cost.py`); `ceiling_over_sync` is the largest speedup any
  schedule could show over the sync run measured here.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from benchmarks.step_cost import StepCostMeter, ceiling

ENGINES = ("jax", "vllm")
DEFAULTS = dict(steps=6, warmup_steps=2, slots=32, max_response_len=256)
VLLM_KV_BYTES = 1 << 30  # SmolLM2-135M fp32 keeps 46 KB a token: 32 full contexts of 450 tokens, no preemption
VLLM_WINDOW_S = 1.0


def add_arguments(parser) -> None:
    """The flags of the real-model comparison (beside rollout.py's --steps, --warmup-steps, --slots,
    --max-response-len, --seed and the APRIL overrides, which it shares)."""
    parser.add_argument(
        "--model",
        default=None,
        help="a real checkpoint (HF folder or asset:NAME): APRIL vs sync on it, "
        "with --engine jax or vllm (benchmarks/rollout_real.py)",
    )
    parser.add_argument(
        "--prompts", default="asset:gsm-symbolic-train", help="--model: jsonl of prompts (field prompt)"
    )
    parser.add_argument("--max-prompt-len", type=int, default=320, help="--model: longer prompts are skipped")
    parser.add_argument("--groups", type=int, default=4, help="--model: prompt groups delivered per step")
    parser.add_argument("--samples", type=int, default=8, help="--model: responses per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="--model: sampling temperature")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="--engine vllm: the interpreter with vLLM (default: $APRIL_JAX_VLLM_PYTHON or .venv-vllm)",
    )


def wanted(args) -> bool:
    return bool(args.model) or args.engine == "vllm"


def fill_defaults(args) -> None:
    if not args.model:
        raise SystemExit("--engine vllm: give --model (a checkpoint folder or asset:smollm2-135m-instruct)")
    for name, value in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if not 0 < args.warmup_steps < args.steps:
        raise SystemExit(f"--warmup-steps {args.warmup_steps}: must be in [1, --steps)")


def load_prompts(model_path: str, prompts_path: str, seed: int, max_prompt_len: int):
    """(prompts, stop ids, longest prompt) as a training run on this checkpoint draws them."""
    from april_jax.data.dataset import PromptDataset, read_rows
    from april_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    rows = read_rows(prompts_path, "prompt", "answer", key="--prompts")
    data = PromptDataset(rows, tok.encode_prompt, seed=seed, max_prompt_len=max_prompt_len, overlong="skip")
    return data, tuple(tok.stop_ids), data.longest[0]


def shortest_prompt(data) -> int:
    return min(len(data.encode(row[0])) for row in data.rows)


def build_engine(args, model, model_path: str, max_model_len: int, prefill_bucket: int):
    if args.engine == "jax":
        from april_jax.config import default_config
        from april_jax.rollout.jax_engine import JaxEngine

        engine = JaxEngine(
            model,
            max_num_seqs=args.slots,
            max_model_len=max_model_len,
            seed=args.seed,
            samples_per_prompt=args.samples,
            smallest_prefill_bucket=prefill_bucket,
            # the product's setting: nothing sleeps between steps here, as on CPU with
            # rollout.free_kv_cache_in_train=false, so held rows resume without a re-prefill
            hold_aborted_kv=default_config().rollout.hold_aborted_kv,
        )
        engine.warmup(modes=("sample",))  # no compile inside a measured step
        return StepCostMeter(engine, window_s=0.0, decode_only=True)
    from april_jax.rollout.vllm.engine import VllmEngine
    from april_jax.rollout.vllm.server import find_vllm_python

    engine = VllmEngine(
        model_path,
        python=find_vllm_python(args.vllm_python),
        max_num_seqs=args.slots,
        max_model_len=max_model_len,
        seed=args.seed,
        kv_cache_bytes=VLLM_KV_BYTES,
        startup_timeout=900.0,
    )  # 30-40 s idle; minutes on a loaded 2-core box
    return StepCostMeter(engine, window_s=VLLM_WINDOW_S, decode_only=False)


def rollout_config(mode: str, args, stop_ids) -> RolloutConfig:
    common = dict(
        rollout_batch_size=args.groups,
        n_samples_per_prompt=args.samples,
        max_response_len=args.max_response_len,
        temperature=args.temperature,
        stop_token_ids=stop_ids,
    )
    if mode == "sync":
        return RolloutConfig(**common, over_sampling_batch_size=args.groups, partial_rollout=False)
    # rollout.py's flags that override one APRIL setting, when given (--over-sampling, --max-staleness, ...)
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RolloutConfig)
        if f.name not in common and getattr(args, f.name, None) is not None
    }
    return RolloutConfig(**common, partial_rollout=True, **given)


def kept_cache_versions(cfg: RolloutConfig) -> int:
    """The vLLM prefix cache's life in weight syncs, as the trainer's builder sets it (no sleep mode here)."""
    from april_jax.config import default_config
    from april_jax.training.builders import kept_prefix_cache_versions

    c = default_config()
    c.rollout.partial_rollout, c.rollout.max_staleness = cfg.partial_rollout, cfg.max_staleness
    return kept_prefix_cache_versions(c)


def lengths_summary(lengths: list[int]) -> dict:
    a = np.asarray(lengths)
    return {
        "n": int(a.size),
        "mean": round(float(a.mean()), 2),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": int(a.max()),
    }


def rate(part: dict) -> dict:
    """Delivered tokens/s of some steps: their compile seconds taken out (programs met for the first
    time; a training run pays each once over hundreds of steps), and with them."""
    steady = part["time_s"] - part["compile_s"]
    return {
        "delivered_tokens": part["tokens"],
        "time_s": round(part["time_s"], 2),
        "compile_s": round(part["compile_s"], 2),
        "delivered_tokens_per_s": round(part["tokens"] / steady, 2),
        "delivered_tokens_per_s_with_compiles": round(part["tokens"] / part["time_s"], 2),
    }


def run_mode(mode: str, engine, params, prompts, cfg: RolloutConfig, args) -> dict:
    """`args.steps` steps of one mode; the figures of the steps after the warm-up, and theirs apart."""
    from april_jax.runtime import compile_clock

    april = April(cfg, prompts)
    engine.update_weights(params, 0)
    w = args.warmup_steps
    parts = {name: dict(tokens=0, time_s=0.0, compile_s=0.0) for name in ("warmup", "measured")}
    lengths, dropped, on_policy, sync_s, truncated = [], 0, 0, 0.0, 0
    wall0 = time.perf_counter()
    for step in range(args.steps):
        part = parts["warmup" if step < w else "measured"]
        if step == w:
            s0, seconds0 = engine.stats(), dict(engine.seconds)
        t0, c0 = engine.now(), compile_clock.seconds()
        groups, m = april.collect(engine, version=step)
        assert len(groups) == cfg.rollout_batch_size and all(len(g.samples) == cfg.n_samples_per_prompt for g in groups)
        t1 = engine.now()
        engine.update_weights(params, step + 1)  # the same weights, the next version: as a train step would
        part["time_s"] += engine.now() - t0
        part["compile_s"] += compile_clock.seconds() - c0
        part["tokens"] += m["rollout/tokens"]
        dropped += m["rollout/dropped_tokens"]
        if step >= w:
            sync_s += engine.now() - t1
            for g in groups:
                for s in g.samples:
                    lengths.append(len(s.response_ids))
                    on_policy += int(np.sum(np.asarray(s.response_versions) == step))
                    truncated += s.status == "truncated"
    s1 = engine.stats()
    steps = s1.decode_steps - s0.decode_steps
    tokens = parts["measured"]["tokens"]
    # where the measured time went: engine steps (decode alone, or with a prefill: JAX), the weight
    # syncs, and the rest (APRIL's bookkeeping, submits, aborts; compiles are inside the steps)
    split = {k: round(engine.seconds[k] - seconds0[k], 2) for k in seconds0}
    split["weight_sync"] = round(sync_s, 2)
    split["other"] = round(parts["measured"]["time_s"] - sum(split.values()), 2)
    return {
        **rate(parts["measured"]),
        "delivered_len": lengths_summary(lengths),
        "truncated_frac": round(truncated / len(lengths), 3),
        "dropped_tokens": dropped,
        "off_policy_token_frac": round(1 - on_policy / tokens, 4),
        "buffered_groups_end": len(april.buffer),
        "buffered_tokens_end": sum(len(s.response_ids) for g in april.buffer.groups() for s in g.samples),
        "occupancy": round((s1.busy_slot_steps - s0.busy_slot_steps) / (steps * s1.slots), 3) if steps else 0.0,
        "time_split_s": split,
        "prefill_tokens": s1.prefill_tokens - s0.prefill_tokens,
        "prompt_copies": getattr(s1, "prompt_copies", 0) - getattr(s0, "prompt_copies", 0),  # JAX engine only
        "warmup": {"steps": w, **rate(parts["warmup"])},
        "wall_s": round(time.perf_counter() - wall0, 1),
    }


def compare(args) -> dict:
    from flax import nnx

    from april_jax import assets
    from april_jax.config import default_config
    from april_jax.models import hf
    from april_jax.runtime import compile_cache

    fill_defaults(args)
    compile_cache.enable(default_config().train.compile_cache_dir)  # a rerun loads the engine's programs
    load_start = os.getloadavg()
    model_path = assets.resolve(args.model)
    prompts_path = assets.resolve(args.prompts)
    data, stop_ids, longest = load_prompts(model_path, prompts_path, args.seed, args.max_prompt_len)
    max_model_len = longest + args.max_response_len
    # the shortest prompt's bucket and up: no program compiled for prompt lengths no prompt has
    prefill_bucket = 1 << (shortest_prompt(data).bit_length() - 1)
    model = hf.from_pretrained(model_path)
    params = nnx.state(model)
    t = time.perf_counter()
    engine = build_engine(args, model, model_path, max_model_len, prefill_bucket)
    ready_s = time.perf_counter() - t
    results = {}
    rng0 = engine.rng_state()  # both modes draw the same request seeds (JAX; vLLM seeds on its own)
    try:
        for mode in ("sync", "april"):
            data.load_state_dict({"epoch": 0, "index": 0})  # both modes: the same prompts in the same order
            engine.set_rng_state(rng0)
            cfg = rollout_config(mode, args, stop_ids)
            if args.engine == "vllm":  # what a training run's builder gives the server in this mode
                engine.engine.keep_prefix_cache_versions = kept_cache_versions(cfg)
            results[mode] = run_mode(mode, engine, params, data, cfg, args)
    finally:
        engine.shutdown()
    costs = engine.costs()
    bound = ceiling(costs)
    sync, april = results["sync"], results["april"]
    cfg = rollout_config("april", args, stop_ids)
    out = {
        "benchmark": "rollout_real",
        "engine": args.engine,
        "model": args.model,
        "prompts": args.prompts,
        "seed": args.seed,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "groups": args.groups,
        "samples": args.samples,
        "slots": args.slots,
        "max_response_len": args.max_response_len,
        "max_model_len": max_model_len,
        "temperature": args.temperature,
        "over_sampling": cfg.over_sampling_batch_size,
        "max_staleness": cfg.max_staleness,
        "refill": cfg.refill,
        "inflight": cfg.inflight,
        "finish_wait": cfg.finish_wait,
        "hold_aborted_kv": default_config().rollout.hold_aborted_kv,
        "vllm_keep_prefix_cache_versions": kept_cache_versions(cfg) if args.engine == "vllm" else None,
        "delivered_speedup": round(april["delivered_tokens_per_s"] / sync["delivered_tokens_per_s"], 3),
        "delivered_speedup_with_compiles": round(
            april["delivered_tokens_per_s_with_compiles"] / sync["delivered_tokens_per_s_with_compiles"], 3
        ),
        "april_tokens_per_s": april["delivered_tokens_per_s"],
        "sync_tokens_per_s": sync["delivered_tokens_per_s"],
        "april": april,
        "sync": sync,
        "step_cost": {str(b): c for b, c in costs.items()},
        "ceiling": {**bound, "rule": "max over b of b / c(b): every step at the best number of running requests"},
        "ceiling_over_sync": (
            round(bound["tokens_per_s"] / sync["delivered_tokens_per_s"], 3) if bound["tokens_per_s"] else None
        ),
        "engine_ready_s": round(ready_s, 1),
        "load_avg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "cpus": os.cpu_count(),
    }
    return out
