"""APRIL vs the synchronous baseline on the same engine and the same prompts.

    python -m benchmarks.rollout --engine sim --config configs/qwen3_4b.py --plan-devices 8xH200-141GB
                                 [--config.KEY=VALUE ...] [--steps 8] [--seed 0] [--png busy.png]
    python -m benchmarks.rollout --engine sim [--cost h200-qwen3-4b] [--replicas 8] [--steps 8] [--seed 0]
                                 [--deployment colocated|disaggregated] [--png busy.png]
    python -m benchmarks.rollout --engine sim --cost cpu-jax       # the earlier CPU-calibrated model, one engine
    python -m benchmarks.rollout --engine jax [--steps 8] [--length-scale 0.03125] [--reuse-aborted-kv]
    python -m benchmarks.rollout --engine jax|vllm --model asset:smollm2-135m-instruct [--seed 0]   # rollout_real.py

Both modes: 32 groups x 8 samples per step, the seed's long-tailed length distribution (scaled
for the JAX engine so it fits on CPU). APRIL is the product's defaults (`RolloutConfig()`: what
`rollout.partial_rollout=true` runs on every engine); a flag overrides one setting only when given.
Sync: over_sampling_batch_size = rollout_batch_size = 32, partial_rollout off. The policy version
goes up by one after every step, as in training.

`--config FILE --plan-devices SPEC` (sim only) simulates what a run of that config would launch on
those devices (`april_jax/training/plan.py`, as `python -m april_jax.train --config FILE --plan
--plan-devices SPEC` prints it): one replica per vLLM server, the roofline of the plan's device
(`cost_model.DEVICES`) at the server's tensor-parallel size, the server's KV tokens and
max_num_seqs as its KV budget and slots, the plan's deployment, its sleep level (0: the server
stays resident beside the trainer and keeps its KV through the update, no sleep paid; 1: it sleeps
and loses its KV) and its training GPUs; and the config's rollout settings (batch, samples per
prompt, over-sampling, max_response_len, max_staleness and the other APRIL keys; dynamic sampling
off: the simulation has no rewards). `--config.KEY=VALUE` overrides a key; the flags the plan
decides (--cost, --replicas, --slots, --deployment, --train-gpus, --max-response-len) are refused
with it. The JSON adds `plan`: the plan's summary.

Accounting (figures over the steps after the first quarter, `--warmup-steps`):
- delivered tokens only: response tokens of the groups delivered to training; tokens still in
  APRIL's buffer at the end are not counted; `dropped_tokens` is over every step, warm-up included;
- rollout time: the engine's time of those steps (prefills, aborts, weight syncs and, colocated,
  sleep and wake included); `rollout_speedup` (also `speedup`) is APRIL's delivered tokens/s over sync's;
- end to end (`--engine sim`): each step also trains, 6 x params x (prompt + response tokens
  delivered) at the cost model's `train_mfu` on the training GPUs (`cost_model.Roofline.train_step_s`);
  `e2e_speedup` is APRIL's steps per second over sync's (both deliver 32 x 8 responses a step);
- `--deployment colocated` (default): rollout and training share the `--replicas` GPUs; the engine
  sleeps through each train step and loses its KV (resumed requests re-prefill). `disaggregated`:
  the engine keeps its KV (resumes skip the prefill) on GPUs of its own, and training runs on
  `--train-gpus` more (default: as many), reported in `gpus`;
- `free_limit_tokens_per_s`: the delivered tokens over the least time any schedule needs for them
  on these replicas (every slot busy, KV budget full, each prompt prefilled once, the syncs and
  sleeps paid; `cost_model.time_lower_bound_s`): independent of the schedule and of any staleness
  cap; `april_fraction_of_free_limit` is the headline fraction;
- `cap_estimate_fraction_of_free_limit` (roofline): what share of that bound a schedule of
  uniform (or two-lane) concurrency without prefill reaches when every response must be decoded
  within max_staleness + 1 steps of time (`benchmarks/probes/rollout_cap_estimate.py`, with these
  replicas, slots, KV budget and response budget); `april_fraction_of_cap_estimate` is APRIL's
  fraction of the free bound over it. An estimate, not a proof: finish_wait lets a step run past
  its target, so APRIL can pass it.
On the JAX engine the model is a tiny random Qwen3 whose responses stop at lengths drawn from the
same distribution (via a per-sample length budget), so the length tail is the seed's and not an
accident of random weights; `limit_tokens_per_s` there is measured with every slot busy.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import numpy as np

from april_jax.data.types import PromptRecord
from april_jax.rollout import cost_model
from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.sim_engine import DEPLOYMENTS, draw_length, length_key
from april_jax.rollout.sim_replicas import SimReplicas
from benchmarks.probes import rollout_cap_estimate


def prompts(seed: int, length: int, vocab: int = 1000):
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        yield PromptRecord(uid=f"p{i}", prompt_ids=rng.integers(1, vocab, length).tolist())


class LengthBudgetEngine:
    """Wraps the JAX engine: each request's max_new_tokens is cut to its drawn remaining length, so a
    random-weight model produces the seed's long tail; finishing there is reported as a stop."""

    def __init__(self, engine, seed: int, scale: float, params):
        self.engine, self.seed, self.scale = engine, seed, scale
        self.params = params  # what each weight sync pushes: the model's own weights, unchanged
        self.progress: dict[str, int] = {}
        self.budget: dict[str, tuple[str, int]] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests):
        import dataclasses

        out = []
        for r in requests:
            total = draw_length(self.seed, length_key(r.sample_key), self.scale)
            left = max(1, total - self.progress.get(r.sample_key, 0))
            natural = left <= r.max_new_tokens
            self.budget[r.request_id] = (r.sample_key, natural)
            out.append(dataclasses.replace(r, max_new_tokens=min(left, r.max_new_tokens)))
        self.engine.submit(out)

    def _fix(self, results):
        for res in results:
            key, natural = self.budget.pop(res.request_id)
            self.progress[key] = self.progress.get(key, 0) + len(res.token_ids)
            if res.finish_reason == "length" and natural:
                res.finish_reason = "stop"
        return results

    def step(self):
        return self._fix(self.engine.step())

    def abort_all(self):
        return self._fix(self.engine.abort_all())


def make_engine(
    kind: str,
    seed: int,
    slots: int,
    length_scale: float,
    max_response_len: int,
    prompt_len: int,
    prefill_ms=None,
    min_prefill_batch: int = 1,
    reuse_aborted_kv: bool = False,
    steps_per_call: int = 8,
    cost: str = "cpu-jax",
    replicas: int = 1,
    step_overhead_ms=None,
    deployment: str = "colocated",
    train_mfu=None,
):
    if kind == "sim":
        overrides = {}
        if cost == "cpu-jax" and prefill_ms is not None:
            overrides["p"] = prefill_ms / 1000
        if cost != "cpu-jax" and step_overhead_ms is not None:
            overrides["step_overhead_s"] = step_overhead_ms / 1000
        if cost != "cpu-jax" and train_mfu is not None:
            overrides["train_mfu"] = train_mfu
        model = cost_model.make(cost, slots, **overrides)
        # the simulated engine keeps aborted KV as a prefix cache would; the deployment decides whether
        # it survives the train step
        return SimReplicas(
            replicas, slots=slots, cost=model, seed=seed, length_scale=length_scale, deployment=deployment
        )
    from april_jax.models import qwen3

    cfg = qwen3.Qwen3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    from april_jax.rollout.jax_engine import JaxEngine

    model = qwen3.init_model(cfg, seed=seed)
    engine = JaxEngine(
        model,
        max_num_seqs=slots,
        max_model_len=prompt_len + max_response_len + 1,
        seed=seed,
        min_prefill_batch=min_prefill_batch,
        reuse_aborted_kv=reuse_aborted_kv,
        samples_per_prompt=8,
        decode_steps_per_call=steps_per_call,
    )
    engine.warmup(modes=("sample",))
    from flax import nnx

    return LengthBudgetEngine(engine, seed, length_scale, nnx.state(model))


# flags that override one APRIL setting when given (None: the product default)
OVERRIDES = (
    "over_sampling_batch_size",
    "max_staleness",
    "stale_policy",
    "refill",
    "resume_count",
    "inflight",
    "finish_wait",
    "inflight_headroom",
)


def rollout_config(mode: str, args) -> RolloutConfig:
    setup = getattr(args, "plan_setup", None)
    if setup is not None:
        base = setup.rollout
    else:
        base = RolloutConfig(
            rollout_batch_size=32, n_samples_per_prompt=8, max_response_len=args.max_response_len, temperature=1.0
        )
    if mode == "sync":
        return dataclasses.replace(base, over_sampling_batch_size=base.rollout_batch_size, partial_rollout=False)
    given = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k, None) is not None}
    return dataclasses.replace(base, partial_rollout=True, **given)


@dataclasses.dataclass
class PlanSetup:
    """What a config's deployment plan launches, in the simulator's terms."""

    cost: cost_model.Roofline  # one server
    servers: int
    deployment: str
    sleeps: bool
    train_gpus: int
    gpus: int  # every GPU the plan uses
    rollout: RolloutConfig
    summary: dict  # the JSON's `plan`


def plan_setup(config_argv: list[str], spec: str, step_overhead_ms=None, train_mfu=None) -> PlanSetup:
    """The plan of `--config FILE [--config.KEY=VALUE ...]` on `spec`, as a roofline per server.
    Raises ConfigError or DeviceSpecError with one line."""
    from april_jax.config import ConfigError, keys
    from april_jax.config.loading import load_config
    from april_jax.training import plan as plan_lib
    from april_jax.training.devices import parse_spec

    c = load_config(["benchmarks.rollout", *config_argv])
    devices = parse_spec(spec)
    if devices.name not in cost_model.DEVICES:
        raise ConfigError(
            f"--plan-devices {spec!r}: the simulator has roofline figures for {', '.join(cost_model.DEVICES)} only"
        )
    plan = plan_lib.make_plan(c, devices)
    if not plan.fits:
        raise ConfigError(plan.error_line())
    servers = plan.servers
    if not servers:
        raise ConfigError(
            f"the plan of {spec} launches no vLLM servers (rollout.engine={c.rollout.engine!r}, "
            f"{plan.rollout['memory']}): the simulator models vLLM servers (--config.rollout.engine=vllm)"
        )
    (tp,), (kv,), (seqs,) = ({getattr(s, k) for s in servers} for k in ("tensor_parallel", "kv_tokens", "max_num_seqs"))
    shape, _ = plan_lib.model_shape(c)
    overrides = {}
    if step_overhead_ms is not None:
        overrides["step_overhead_s"] = step_overhead_ms / 1000
    if train_mfu is not None:
        overrides["train_mfu"] = train_mfu
    cost = cost_model.for_device(
        devices.name,
        shape,
        name=f"{devices.name.lower()}-tp{tp}-plan",
        hbm_bytes=devices.bytes_per_device,
        tensor_parallel=tp,
        kv_tokens=kv,
        dtype_bytes=plan_lib.DTYPE_BYTES[c.model.compute_dtype],
        **overrides,
    )
    # the same model and KV sizes as the plan's, or the two disagree on what they simulate
    assert cost.params == plan.model["parameters"] and cost.kv_bytes_per_token == plan.model["kv_bytes_per_token"]
    sleep_level = plan.rollout["sleep_level"]
    train_gpus = len(plan.trainer["devices"])
    serving = sorted({d for s in servers for d in s.devices})
    rollout = dataclasses.replace(keys.rollout_cfg(c), dynamic_sampling=False)
    summary = {
        "devices": devices.describe(),
        "config": list(config_argv),
        "deployment": plan.deployment,
        "servers": len(servers),
        "tensor_parallel": tp,
        "kv_tokens_per_server": kv,
        "kv_cache_bytes_per_gpu": servers[0].kv_cache_bytes,
        "max_num_seqs": seqs,
        "sleep_level": sleep_level,
        "memory": plan.rollout["memory"],
        "train_gpus": train_gpus,
        "trainer_mesh": plan.trainer["mesh"],
        "model": plan.model["shape_from"],
        "parameters": plan.model["parameters"],
        "max_model_len": plan.model["max_model_len"],
    }
    return PlanSetup(
        cost=cost,
        servers=len(servers),
        deployment=plan.deployment,
        sleeps=sleep_level > 0,
        train_gpus=train_gpus,
        gpus=len(set(serving) | set(plan.trainer["devices"])),
        rollout=rollout,
        summary=summary,
    )


def train_gpus(args) -> int:
    if getattr(args, "plan_setup", None) is not None:
        return args.plan_setup.train_gpus
    return args.replicas if args.deployment == "colocated" else (args.train_gpus or args.replicas)


def total_gpus(args) -> int:
    if getattr(args, "plan_setup", None) is not None:
        return args.plan_setup.gpus
    return args.replicas if args.deployment == "colocated" else args.replicas + train_gpus(args)


def sim_engine(args, seed: int) -> SimReplicas:
    """The simulated replicas of a plan (`--config`): one per server, each its roofline."""
    setup = args.plan_setup
    return SimReplicas(
        setup.servers,
        slots=args.slots,
        cost=setup.cost,
        seed=seed,
        length_scale=args.length_scale,
        deployment=setup.deployment,
        sleeps=setup.sleeps,
    )


def end_to_end(rollout_s: float, train_s: list[float], delivered_tokens: float) -> dict:
    """A run's end-to-end figures: its steps one after another, each its rollout then its train step."""
    total = rollout_s + sum(train_s)
    return {
        "e2e_time_s": total,
        "e2e_steps_per_s": len(train_s) / total,
        "e2e_tokens_per_s": delivered_tokens / total,
        "train_time_s": sum(train_s),
    }


def run(mode: str, args) -> dict:
    cfg = rollout_config(mode, args)
    if getattr(args, "plan_setup", None) is not None:
        engine = sim_engine(args, args.seed)
    else:
        engine = make_engine(
            args.engine,
            args.seed,
            args.slots,
            args.length_scale,
            args.max_response_len,
            args.prompt_len,
            args.prefill_ms_per_token,
            args.min_prefill_batch,
            args.reuse_aborted_kv and mode != "sync",
            args.decode_steps_per_call,
            args.cost,
            args.replicas,
            args.step_overhead_ms,
            args.deployment,
            args.train_mfu,
        )
    april = April(cfg, prompts(args.seed, args.prompt_len))
    w = args.warmup_steps
    delivered_tokens = on_policy = weight = 0.0
    ctx_sum = 0
    prompt_lens, lengths, train_s = [], [], []
    steps, timeline = [], []
    for step in range(args.steps):
        if step == w:
            start, s_start = engine.now(), engine.stats()
        groups, m = april.collect(engine, version=step)
        assert len(groups) == cfg.rollout_batch_size
        assert all(len(g.samples) == cfg.n_samples_per_prompt for g in groups)
        # the simulated engine has no model: its syncs (and, colocated, the sleep) cost what the cost model says
        engine.update_weights(engine.params if args.engine == "jax" else None, step + 1)
        steps.append(m)
        timeline += engine.timeline  # the engine keeps only its latest points: drain them every step
        engine.timeline.clear()
        if step >= w:
            delivered_tokens += m["rollout/tokens"]
            trained = 0
            for g in groups:
                prompt_lens.append(len(g.prompt.prompt_ids))
                for s in g.samples:
                    stale = step - np.asarray(s.response_versions)
                    on_policy += float(np.sum(stale == 0))
                    weight += float(np.sum(0.9**stale))
                    lengths.append(len(s.response_ids))
                    ctx_sum += cost_model.delivered_ctx_sum(len(s.prompt_ids), len(s.response_ids))
                    trained += len(s.prompt_ids) + len(s.response_ids)
            if args.engine == "sim":
                train_s.append(engine.cost.train_step_s(trained, train_gpus(args)))
    time = engine.now() - start
    s_end = engine.stats()
    window = steps[w:]
    buffered = sum(len(s.response_ids) for g in april.buffer.groups() for s in g.samples)
    out = {
        "delivered_tokens_per_s": delivered_tokens / time,
        "delivered_tokens": delivered_tokens,
        "buffered_tokens_end": buffered,
        "off_policy_token_frac": 1 - on_policy / delivered_tokens,
        "dropped_tokens": sum(m["rollout/dropped_tokens"] for m in steps),
        # finish_wait: engine time spent past the target, and groups delivered in a fresher one's place
        "finish_wait_s": sum(m.get("rollout/finish_wait_s", 0.0) for m in window),
        "swapped_groups": sum(m.get("rollout/swapped_groups", 0) for m in window),
        "prefill_tokens_per_response_token": sum(m["rollout/prefill_tokens"] for m in window) / delivered_tokens,
        "occupancy": float(np.mean([m["rollout/occupancy"] for m in window])),
        "on_policy_token_frac": on_policy / delivered_tokens,
        "mean_loss_weight": weight / delivered_tokens,
        "delivered_len_mean": float(np.mean(lengths)),
        "staleness_max": max(m["rollout/staleness_max"] for m in steps),
        "time_s": time,
        "timeline": timeline,
        "steps": steps,
    }
    out["tokens_per_s"] = out["delivered_tokens_per_s"]
    if args.engine == "sim":
        replicas = len(engine.replicas)
        free = cost_model.time_lower_bound_s(
            engine.cost,
            tokens=int(delivered_tokens),
            ctx_sum=ctx_sum,
            prompt_lens=prompt_lens,
            slots=args.slots,
            replicas=replicas,
            syncs=args.steps - w,
        )
        if engine.replicas[0].sleeps:  # every schedule sleeps through the same train steps
            free += (args.steps - w) * engine.cost.sleep_wake_s()
        out.update(
            free_limit_tokens_per_s=delivered_tokens / free,
            **end_to_end(time, train_s, delivered_tokens),
            prefill_time_frac=(s_end.prefill_time_s - s_start.prefill_time_s) / (replicas * time),
            kv_bytes_peak=s_end.kv_bytes_peak,
            kv_bytes_budget=engine.cost.kv_budget_bytes,
            preempted=s_end.preempted - s_start.preempted,
            kv_reused=s_end.kv_reused - s_start.kv_reused,
            kv_lost_in_sleep=s_end.kv_lost_in_sleep - s_start.kv_lost_in_sleep,
            sleeps=engine.replicas[0].sleeps,
        )
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["sim", "jax", "vllm"], default="sim")
    parser.add_argument(
        "--config",
        default=None,
        help="sim only: a training config (configs/*.py): simulate what its deployment plan launches on "
        "--plan-devices (servers, tensor parallel, KV, max_num_seqs, sleep) with its rollout settings; "
        "--config.KEY=VALUE overrides a key",
    )
    parser.add_argument(
        "--plan-devices",
        default=None,
        help="with --config: the devices to plan for, COUNTxNAME-MEMGB (8xH200-141GB, 8xH100-80GB, 8xMI300X-192GB)",
    )
    parser.add_argument(
        "--cost",
        default=None,
        help="sim only: a roofline preset (h200-qwen3-4b, the default; h100-qwen3-4b, h200-qwen3-8b) or cpu-jax",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="sim only: engine replicas, one per GPU (default 8 for a roofline preset, 1 for cpu-jax)",
    )
    parser.add_argument(
        "--deployment",
        choices=DEPLOYMENTS,
        default=None,
        help="sim only: rollout and training share the GPUs (colocated, the default: the engine sleeps "
        "through the train step and loses its KV), or the engine has GPUs of its own and keeps its KV",
    )
    parser.add_argument(
        "--train-gpus",
        type=int,
        default=None,
        help="sim, disaggregated: training GPUs beside the rollout replicas (default: as many)",
    )
    parser.add_argument("--train-mfu", type=float, default=None, help="roofline presets: training MFU (default 0.35)")
    parser.add_argument("--steps", type=int, default=None, help="default: 8 (6 with --model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps left out of the figures (default: a quarter of --steps, at least 1): APRIL's "
        "buffer fills over the first few steps; a real run amortises that over hundreds",
    )
    parser.add_argument(
        "--slots", type=int, default=None, help="max running requests per replica (default: 256 sim, 64 jax)"
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="default: 1.0 sim, 1/32 jax (responses up to 1024 tokens: the largest scale "
        "that runs in ~6 minutes on 2 cores; at 1/64 half the responses are under 16 tokens "
        "and per-request costs weigh more than at any real scale)",
    )
    parser.add_argument("--max-response-len", type=int, default=None)
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="default: 64 x length scale, at least 8 (all lengths scaled alike)"
    )
    default = RolloutConfig()
    for name, kind, choices in (
        ("over_sampling_batch_size", int, None),
        ("max_staleness", int, None),
        ("stale_policy", str, ("restart", "drop_group")),
        ("refill", str, ("groups", "members")),
        ("resume_count", str, ("fraction", "group")),
        ("inflight", str, ("over_sampling", "auto")),
        ("finish_wait", float, None),
        ("inflight_headroom", float, None),
    ):
        flag = "--over-sampling" if name == "over_sampling_batch_size" else "--" + name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            choices=choices,
            default=None,
            help=f"APRIL's rollout.{name} (default: the product's, {getattr(default, name)!r})",
        )
    parser.add_argument(
        "--prefill-ms-per-token", type=float, default=None, help="--cost cpu-jax only; default: the CPU-calibrated 0.73"
    )
    parser.add_argument(
        "--step-overhead-ms", type=float, default=None, help="roofline presets: per decode step (default 1)"
    )
    parser.add_argument(
        "--min-prefill-batch", type=int, default=1, help="jax only: refill when this many slots are free"
    )
    parser.add_argument(
        "--reuse-aborted-kv",
        action="store_true",
        help="jax only: APRIL's resumed requests take their parked KV instead of a re-prefill",
    )
    parser.add_argument("--decode-steps-per-call", type=int, default=8, help="jax only")
    parser.add_argument("--png", default=None, help="write busy slots over time for both modes")
    parser.add_argument("--full", action="store_true", help="also print per-step metrics")
    # a real checkpoint on a real engine (--model, or --engine vllm): benchmarks/rollout_real.py
    from benchmarks import rollout_real as real

    real.add_arguments(parser)
    argv = sys.argv[1:]
    config_overrides = [a for a in argv if a.startswith("--config.")]
    args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
    planned = args.config is not None or args.plan_devices is not None or bool(config_overrides)
    if planned:
        from_plan(parser, args, config_overrides)
    if real.wanted(args):
        print(json.dumps(real.compare(args)))
        return
    if args.steps is None:
        args.steps = 8
    if args.cost is None:
        args.cost = "h200-qwen3-4b"
    if args.deployment is None:
        args.deployment = "colocated"
    if args.replicas is None:
        args.replicas = 8 if args.engine == "sim" and args.cost != "cpu-jax" else 1
    if args.engine == "sim" and args.cost != "cpu-jax" and args.cost not in cost_model.PRESETS and not planned:
        parser.error(f"--cost {args.cost!r}: unknown; choose from cpu-jax, {', '.join(cost_model.PRESETS)}")
    if args.train_gpus is not None and (args.train_gpus <= 0 or args.deployment != "disaggregated"):
        parser.error(f"--train-gpus {args.train_gpus}: a positive count, with --deployment disaggregated only")
    if args.train_mfu is not None and not 0 < args.train_mfu <= 1:
        parser.error(f"--train-mfu {args.train_mfu}: must be in (0, 1]")
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 4)
    if not 0 < args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be in [1, --steps)")
    if args.slots is None:
        args.slots = 256 if args.engine == "sim" else 64
    if args.length_scale is None:
        args.length_scale = 1.0 if args.engine == "sim" else 1 / 32
    if args.prompt_len is None:
        args.prompt_len = max(8, round(64 * args.length_scale))
    if args.max_response_len is None:
        args.max_response_len = int(32768 * args.length_scale)
    print(json.dumps(compare(args)))


# flags the plan decides: given with --config, they would contradict it
PLAN_DECIDES = {
    "cost": "the plan's device and model",
    "replicas": "the plan's servers",
    "slots": "rollout.max_num_seqs",
    "deployment": "rollout.deployment",
    "train_gpus": "the plan's trainer (rollout.gpus)",
    "max_response_len": "rollout.max_response_len",
}


def from_plan(parser, args, config_overrides: list[str]) -> None:
    """Fill args from --config's deployment plan on --plan-devices (sim only); a bad one is a parser error."""
    from april_jax.config import ConfigError
    from april_jax.training.devices import DeviceSpecError

    if args.config is None:
        parser.error("--plan-devices and --config.KEY=VALUE need --config FILE")
    if args.engine != "sim" or args.model:
        parser.error(
            "--config: --engine sim only (the simulator runs the plan; a real run is python -m april_jax.train)"
        )
    if args.plan_devices is None:
        parser.error("--config: give --plan-devices COUNTxNAME-MEMGB (e.g. 8xH200-141GB), the devices to plan for")
    for name, what in PLAN_DECIDES.items():
        if getattr(args, name) is not None:
            parser.error(
                f"--{name.replace('_', '-')}: with --config it comes from {what} (--config.KEY=VALUE sets keys)"
            )
    try:
        setup = plan_setup(
            ["--config", args.config, *config_overrides], args.plan_devices, args.step_overhead_ms, args.train_mfu
        )
    except (ConfigError, DeviceSpecError) as e:
        parser.error(str(e))
    args.plan_setup = setup
    args.cost = setup.cost.name
    args.replicas = setup.servers
    args.slots = setup.summary["max_num_seqs"]
    args.deployment = setup.deployment
    args.max_response_len = setup.rollout.max_response_len


def make_cost(args):
    """The cost model of one simulated replica, as the run's engine has it."""
    if getattr(args, "plan_setup", None) is not None:
        return args.plan_setup.cost
    return make_engine(
        "sim",
        0,
        args.slots,
        1.0,
        1,
        1,
        args.prefill_ms_per_token,
        cost=args.cost,
        step_overhead_ms=args.step_overhead_ms,
        train_mfu=args.train_mfu,
    ).cost


def compare(args) -> dict:
    if args.engine == "sim":
        sync, april = run("sync", args), run("april", args)
        limits = [april["free_limit_tokens_per_s"]]
    else:
        # Measured before and after the two runs and averaged: this machine drifts by 10-20% over
        # minutes, and a limit taken at one end only would tilt the fractions.
        limits = [measure_jax_limit(args)]
        sync, april = run("sync", args), run("april", args)
        limits.append(measure_jax_limit(args))
    cfg = rollout_config("april", args)
    out = {
        "benchmark": "rollout",
        "engine": args.engine,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "seed": args.seed,
        "slots": args.slots,
        "length_scale": args.length_scale,
        "max_response_len": args.max_response_len,
        "prompt_len": args.prompt_len,
        "prefill_ms_per_token": args.prefill_ms_per_token,
        "min_prefill_batch": args.min_prefill_batch,
        "reuse_aborted_kv": args.reuse_aborted_kv,
        "decode_steps_per_call": args.decode_steps_per_call,
        "over_sampling": cfg.over_sampling_batch_size,
        **{k: getattr(cfg, k) for k in OVERRIDES[1:]},
        "sync_tokens_per_s": round(sync["tokens_per_s"], 1),
        "april_tokens_per_s": round(april["tokens_per_s"], 1),
        "rollout_speedup": round(april["tokens_per_s"] / sync["tokens_per_s"], 3),
        "april_occupancy": round(april["occupancy"], 3),
        "sync_occupancy": round(sync["occupancy"], 3),
        "off_policy_token_frac": round(april["off_policy_token_frac"], 3),
        "april_prefill_tokens_per_response_token": round(april["prefill_tokens_per_response_token"], 2),
        "sync_prefill_tokens_per_response_token": round(sync["prefill_tokens_per_response_token"], 2),
        "dropped_tokens": april["dropped_tokens"],
        "sync_dropped_tokens": sync["dropped_tokens"],
        "april_delivered_tokens": april["delivered_tokens"],
        "sync_delivered_tokens": sync["delivered_tokens"],
        "april_buffered_tokens_end": april["buffered_tokens_end"],
        "delivered_len_ratio": round(april["delivered_len_mean"] / sync["delivered_len_mean"], 4),
        "april_staleness_max": april["staleness_max"],
        "april_finish_wait_frac": round(april["finish_wait_s"] / april["time_s"], 4),
        "april_swapped_groups": april["swapped_groups"],
    }
    out["speedup"] = out["rollout_speedup"]
    for name, r in (("april", april), ("sync", sync)):
        for key in ("on_policy_token_frac", "mean_loss_weight", "delivered_len_mean"):
            out[f"{name}_{key}"] = round(r[key], 4)
    if args.engine == "sim":
        out["cost"] = make_cost(args).describe()
        if getattr(args, "plan_setup", None) is not None:
            out["plan"] = args.plan_setup.summary
        out["replicas"] = args.replicas
        out["deployment"] = args.deployment
        out["engine_sleeps"] = april["sleeps"]
        out["train_gpus"] = train_gpus(args)
        out["gpus"] = total_gpus(args)
        out["kv_bytes_budget"] = out["cost"].get("kv_budget_bytes")
        out["e2e_speedup"] = round(april["e2e_steps_per_s"] / sync["e2e_steps_per_s"], 3)
        out["e2e_token_speedup"] = round(april["e2e_tokens_per_s"] / sync["e2e_tokens_per_s"], 3)
        # the schedule-independent bound, each run's own delivered tokens: APRIL's is the headline fraction
        out["free_limit_tokens_per_s"] = round(april["free_limit_tokens_per_s"], 1)
        out["sync_free_limit_tokens_per_s"] = round(sync["free_limit_tokens_per_s"], 1)
        out["april_fraction_of_free_limit"] = round(april["tokens_per_s"] / april["free_limit_tokens_per_s"], 3)
        out["cap_estimate_fraction_of_free_limit"] = out["april_fraction_of_cap_estimate"] = None
        if args.cost != "cpu-jax":
            cap = rollout_cap_estimate.cap_fraction(
                make_cost(args),
                replicas=args.replicas,
                slots=args.slots,
                max_response_len=cfg.max_response_len,
                max_staleness=cfg.max_staleness,
                prompt_len=args.prompt_len,
                per_step=cfg.rollout_batch_size * cfg.n_samples_per_prompt,
            )
            out["cap_estimate_fraction_of_free_limit"] = cap
            out["april_fraction_of_cap_estimate"] = round(out["april_fraction_of_free_limit"] / cap, 3)
        out["sync_fraction_of_free_limit"] = round(sync["tokens_per_s"] / sync["free_limit_tokens_per_s"], 3)
        out["april_inflight_limit_last"] = april["steps"][-1].get("rollout/inflight_limit")
        for name, r in (("april", april), ("sync", sync)):
            for key in ("e2e_tokens_per_s", "e2e_steps_per_s"):
                out[f"{name}_{key}"] = round(r[key], 7 if "steps" in key else 1)
            out[f"{name}_e2e_tokens_per_s_per_gpu"] = round(r["e2e_tokens_per_s"] / out["gpus"], 1)
            out[f"{name}_train_time_frac"] = round(r["train_time_s"] / r["e2e_time_s"], 4)
            out[f"{name}_prefill_time_frac"] = round(r["prefill_time_frac"], 4)
            out[f"{name}_kv_bytes_peak"] = r["kv_bytes_peak"]
            out[f"{name}_preempted"] = r["preempted"]
            out[f"{name}_kv_reused"] = r["kv_reused"]
            out[f"{name}_time_s"] = round(r["time_s"], 2)
    else:
        limit = float(np.mean(limits))
        out.update(
            limit_tokens_per_s=round(limit, 1),
            limit_before_after=[round(x, 1) for x in limits],
            april_fraction_of_limit=round(april["tokens_per_s"] / limit, 3),
            sync_fraction_of_limit=round(sync["tokens_per_s"] / limit, 3),
        )
    if getattr(args, "png", None):
        plot(sync["timeline"], april["timeline"], args)
    if getattr(args, "full", False):
        out["april_steps"], out["sync_steps"] = april["steps"], sync["steps"]
    return out


def measure_jax_limit(args) -> float:
    """Tokens/s of the JAX engine with every slot busy: long greedy requests, no stops."""
    from april_jax.rollout.types import Request, SamplingParams

    engine = make_engine(
        "jax",
        args.seed,
        args.slots,
        1.0,
        args.max_response_len,
        args.prompt_len,
        steps_per_call=args.decode_steps_per_call,
    ).engine
    n = args.max_response_len
    reqs = lambda tag: [
        Request(f"{tag}{i}", list(range(1, args.prompt_len + 1)), n, SamplingParams(1.0, seed=i))
        for i in range(args.slots)
    ]
    engine.generate(reqs("warm"))
    t0, before = engine.now(), engine.stats().tokens_generated
    engine.submit(reqs("run"))
    for _ in range(n // 2):  # decode-only window: all slots busy
        engine.step()
    rate = (engine.stats().tokens_generated - before - args.slots) / (engine.now() - t0)
    engine.abort_all()
    return rate


def plot(sync_tl, april_tl, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for label, tl in (("sync", sync_tl), ("APRIL", april_tl)):
        t, busy = zip(*tl)
        t = np.asarray(t) - t[0]  # from the first decode step: engine clocks also count warm-up
        ax.step(t, busy, where="pre", label=label, lw=0.8)
    ax.set_xlabel("engine time (s)" + (" (simulated)" if args.engine == "sim" else ""))
    ax.set_ylabel("busy slots")
    cfg = rollout_config("april", args)
    per_step = f"{cfg.rollout_batch_size}x{cfg.n_samples_per_prompt}"
    ax.set_title(f"{args.engine} engine, {args.slots} slots, {args.steps} steps of {per_step}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
