"""APRIL orchestrator on the simulated engine (invariants over many steps) and the JAX engine (resume)."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from april_jax.data.types import PromptRecord
from april_jax.models import qwen3
from april_jax.rollout import cost_model
from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.sim_engine import SimEngine, draw_length
from april_jax.rollout.sim_replicas import SimReplicas
from april_jax.rollout.types import Request, SamplingParams
from tiny_models import TINY_QWEN3


def prompt_stream(prefix="p", length=8, vocab=500, seed=0):
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        yield PromptRecord(uid=f"{prefix}{i}", prompt_ids=rng.integers(1, vocab, length).tolist())


def run_steps(cfg, steps, reward_fn=None, slots=16, length_scale=1 / 64, engine=None):
    engine = engine or SimEngine(slots=slots, seed=1, length_scale=length_scale)
    april = April(cfg, prompt_stream(), reward_fn)
    delivered = []
    for step in range(steps):
        groups, metrics = april.collect(engine, version=step)
        delivered.append((step, groups, metrics))
        engine.update_weights(None, step + 1)
    return april, engine, delivered


def check_invariants(cfg, april, delivered):
    seen = []
    for step, groups, _ in delivered:
        assert len(groups) == cfg.rollout_batch_size
        for g in groups:
            assert len(g.samples) == cfg.n_samples_per_prompt and g.complete
            seen.append(g.prompt.uid)
            for s in g.samples:
                assert 0 < len(s.response_ids) <= cfg.max_response_len
                assert len(s.response_logprobs) == len(s.response_versions) == len(s.response_ids)
                assert s.staleness(step) <= cfg.max_staleness
                assert all(v <= step for v in s.response_versions)
                assert all(np.diff(s.response_versions) >= 0), "versions go back along a response"
    assert len(seen) == len(set(seen)), "a prompt was delivered twice"
    buffered = {g.prompt.uid for g in april.buffer._groups}
    dropped = set(april.dropped)
    assert not (set(seen) & buffered) and not (set(seen) & dropped) and not (buffered & dropped)
    assert len(seen) + len(buffered) + len(dropped) == april.drawn, "a drawn prompt was lost"


@pytest.mark.parametrize(
    "stale_policy,refill,resume_count",
    [
        ("restart", "groups", "fraction"),
        ("drop_group", "groups", "fraction"),
        ("restart", "groups", "group"),
        ("restart", "members", "fraction"),
    ],
)
def test_invariants_over_many_steps(stale_policy, refill, resume_count):
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=8,
        max_response_len=300,
        max_staleness=2,
        stale_policy=stale_policy,
        stop_token_ids=(0,),
        refill=refill,
        resume_count=resume_count,
        inflight="over_sampling",
    )
    april, engine, delivered = run_steps(cfg, 15)
    check_invariants(cfg, april, delivered)
    metrics = [m for _, _, m in delivered]
    assert sum(m["rollout/aborted"] for m in metrics) > 0 and sum(m["rollout/resumed"] for m in metrics) > 0
    assert max(m["rollout/off_policy_token_frac"] for m in metrics) > 0
    key = "rollout/stale_restarts" if stale_policy == "restart" else "rollout/stale_dropped_groups"
    assert sum(m[key] for m in metrics) > 0
    # Some responses were truncated at the budget: the seed's tail exceeds 300 tokens at this scale.
    assert any(m["rollout/truncated_frac"] > 0 for m in metrics)
    assert all(m["rollout/response_len/max"] <= 300 for m in metrics)
    # finish_wait (default 1.0) acts under inflight="auto" only: here it never waits or swaps
    assert all(m["rollout/finish_wait_s"] == 0 and m["rollout/swapped_groups"] == 0 for m in metrics)
    assert april.state_dict()["step_time"] == [0, 0]


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_invariants_on_roofline_replicas_with_a_tight_kv_budget(deployment):
    """Two H200 replicas with room for ~3000 KV tokens each, every request in flight at once:
    admission waits, requests are preempted, parked KV competes for the same memory (and survives
    the train step only disaggregated); nothing is lost and the budget holds."""
    base = cost_model.make("h200-qwen3-4b")
    hbm = (3000 * base.kv_bytes_per_token + base.weight_bytes + base.activation_reserve_bytes) / base.mem_util
    cost = cost_model.Roofline(**{**dataclasses.asdict(base), "hbm_bytes": hbm})
    engine = SimReplicas(2, slots=16, cost=cost, seed=1, length_scale=1 / 16, deployment=deployment)
    reuse = deployment == "disaggregated"
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=8,
        max_response_len=1500,
        max_staleness=3,
        stop_token_ids=(0,),
        inflight="over_sampling",
    )
    april, engine, delivered = run_steps(cfg, 10, engine=engine)
    check_invariants(cfg, april, delivered)
    stats = engine.stats()
    assert stats.preempted > 0 and stats.kv_tokens_peak <= cost.kv_budget_tokens
    assert stats.kv_reused > 0 if reuse else stats.kv_reused == 0
    assert_bounds_hold(cost, cfg, delivered, engine, replicas=2, slots=16)


def assert_bounds_hold(cost, cfg, delivered, engine, replicas, slots):
    """The free and the staleness-windowed lower bounds never exceed the simulated time, and the
    windowed one is at least the free one (each response's tokens within [step - cap, step])."""
    rows = [
        (len(g.prompt.prompt_ids), len(s.response_ids), max(step - cfg.max_staleness, 0), step)
        for step, gs, _ in delivered
        for g in gs
        for s in g.samples
    ]
    ctx = [np.arange(n) + p for p, n, _, _ in rows]
    kw = dict(
        tokens=sum(n for _, n, _, _ in rows),
        ctx_sum=int(sum(c.sum() for c in ctx)),
        prompt_lens=[8] * (len(rows) // cfg.n_samples_per_prompt),
        slots=slots,
        replicas=replicas,
        syncs=len(delivered) - 1,
    )
    windows = cost_model.StalenessWindows(
        tokens=np.array([len(c) for c in ctx], float),
        sqrt_ctx=np.array([np.sqrt(c).sum() for c in ctx]),
        ctx=np.array([c.sum() for c in ctx], float),
        first=np.array([r[2] for r in rows]),
        last=np.array([r[3] for r in rows]),
        steps=len(delivered),
    )
    free = cost_model.time_lower_bound_s(cost, **kw)
    bound = cost_model.time_lower_bound_s(cost, **kw, windows=windows)
    assert free <= bound <= engine.now()
    return free, bound


class Outstanding:
    """Counts the requests an engine holds (submitted, not yet returned) at every call."""

    def __init__(self, engine):
        self.engine, self.now_out, self.peak = engine, 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests):
        requests = list(requests)
        self.now_out += len(requests)
        self.peak = max(self.peak, self.now_out)
        self.engine.submit(requests)

    def step(self):
        out = self.engine.step()
        self.now_out -= len(out)
        return out

    def abort_all(self):
        out = self.engine.abort_all()
        self.now_out -= len(out)
        return out


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_inflight_auto_sizes_requests_by_the_staleness_cap_and_the_kv_budget(max_staleness):
    """inflight="auto": after the first step, no more requests run than the cap allows (R <= cap x
    tokens delivered per step / max_response_len) and than fit 0.85 of the KV budget at the measured
    token-weighted context; before anything is delivered, no more than a synchronous step. The
    invariants and the KV budget hold, and the simulated time respects both lower bounds."""
    base = cost_model.make("h200-qwen3-4b")
    hbm = (20_000 * base.kv_bytes_per_token + base.weight_bytes + base.activation_reserve_bytes) / base.mem_util
    cost = cost_model.Roofline(**{**dataclasses.asdict(base), "hbm_bytes": hbm})
    engine = SimReplicas(2, slots=64, cost=cost, seed=2, length_scale=1 / 16, reuse_aborted_kv=True)
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=16,
        max_response_len=2048,
        max_staleness=max_staleness,
        stop_token_ids=(0,),
        refill="members",
        inflight="auto",
    )
    april = April(cfg, prompt_stream())
    wrapped, delivered, peaks = Outstanding(engine), [], []
    for step in range(8):
        seen = dict(april.seen)
        expected = cfg.rollout_batch_size * 4
        if seen["responses"]:
            per_step = 4 * 4 * seen["tokens"] / seen["responses"]
            expected = min(
                16 * 4, int((max_staleness + 1 + cfg.inflight_headroom) * per_step / 2048)
            )  # at the step's start
        ctx = seen["ctx"] / seen["tokens"] if seen["tokens"] else 1024
        expected = max(min(expected, int(0.85 * 2 * cost.kv_budget_tokens / ctx)), 4)
        wrapped.peak = wrapped.now_out  # 0: every request was aborted at the last step's end
        carried = sum(len(g.samples) for g in april.buffer.groups())
        groups, m = april.collect(wrapped, version=step)
        assert m["rollout/inflight_limit"] == expected
        # buffered groups' members (resumed or restarted) all start at the step's start, whatever
        # the limit (drawn prompts are never lost); a fresh group starts only while the limit has room
        peaks.append(wrapped.peak)
        assert wrapped.peak <= max(expected, carried)
        delivered.append((step, groups, m))
        engine.update_weights(None, step + 1)
    assert max(peaks) > 0
    check_invariants(cfg, april, delivered)
    assert engine.stats().kv_tokens_peak <= cost.kv_budget_tokens
    assert_bounds_hold(cost, cfg, delivered, engine, replicas=2, slots=64)


def test_inflight_auto_limit_shrinks_over_the_step_by_the_steps_a_start_has_left():
    """A response started when a fraction f of the step's groups is delivered has max_staleness + 1 - f
    steps before its cap: 4 x 4 responses of 1000 tokens per step, max_response_len 2048, cap 2:
    R = int((3 - f) x 16000 / 2048) = 23 at the start, 19 half-way, 15 at the end (the old
    max_staleness-steps sizing), within over-sampling 16 x 4; the KV budget (CPU model) is unbounded.
    inflight_headroom h adds h steps: int((3.5 - f) x 16000 / 2048) = 27, 23, 19 at h = 0.5."""
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=16,
        max_response_len=2048,
        max_staleness=2,
        inflight="auto",
        inflight_headroom=0.0,
    )
    april = April(cfg, prompt_stream())
    april.seen = {"responses": 16, "tokens": 16_000, "ctx": 16 * (1000 * 8 + 1000 * 999 // 2)}
    engine = SimEngine(slots=64)
    assert [april.inflight_limit(engine, f) for f in (0.0, 0.5, 1.0)] == [23, 19, 15]
    april.cfg = dataclasses.replace(cfg, inflight_headroom=0.5)
    assert [april.inflight_limit(engine, f) for f in (0.0, 0.5, 1.0)] == [27, 23, 19]
    assert April(dataclasses.replace(cfg, inflight="over_sampling"), prompt_stream()).inflight_limit(engine, 0.5) == 64


@pytest.mark.parametrize("cutoff", [0.5, 1.0])
def test_inflight_auto_starts_no_fresh_group_past_the_late_start_cutoff(cutoff):
    """With late_start_cutoff 0.5 no fresh group starts once half the step's groups are delivered (the
    groups in flight always suffice here); without a cutoff (1.0) some do, so the check can fail."""
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=16,
        max_response_len=2000,
        max_staleness=3,
        refill="members",
        inflight="auto",
        late_start_cutoff=cutoff,
    )
    april, _, delivered = run_steps(cfg, 10, slots=64, length_scale=1 / 16)
    check_invariants(cfg, april, delivered)
    late = [m["rollout/fresh_start_progress_max"] for _, _, m in delivered]
    if cutoff < 1:
        assert max(late) < cutoff
    else:
        assert max(late) >= 0.5


def test_finish_wait_saves_groups_at_their_last_allowed_version():
    """inflight="auto" with finish_wait: once the target is met, the engine keeps going (no fresh start)
    while a response that would pass max_staleness at the next step is in flight, and a group that
    finishes then is delivered in place of the freshest delivered group, which waits in the buffer
    within its cap. Against finish_wait 0 on the same run: fewer responses restarted at the cap, some
    groups swapped, and nothing lost, delivered twice
    or past the cap either way."""
    runs = {}
    for wait in (0.0, 1.0):
        cfg = RolloutConfig(
            rollout_batch_size=16,
            n_samples_per_prompt=4,
            over_sampling_batch_size=32,
            max_response_len=2048,
            max_staleness=2,
            stop_token_ids=(0,),
            refill="members",
            inflight="auto",
            finish_wait=wait,
            inflight_headroom=0.75,
        )
        engine = SimReplicas(
            2, slots=64, cost=cost_model.make("h200-qwen3-4b"), seed=3, length_scale=1 / 16, reuse_aborted_kv=True
        )
        april, engine, delivered = run_steps(cfg, 14, engine=engine)
        check_invariants(cfg, april, delivered)
        metrics = [m for _, _, m in delivered]
        runs[wait] = metrics
        waits = [m["rollout/finish_wait_s"] for m in metrics]
        assert waits[0] == 0  # no step time measured yet
        assert (max(waits) > 0) == (wait > 0)
        if wait:  # the wait's unit is the engine's decode steps (deterministic on every engine), not seconds
            assert april.state_dict()["step_time"] == [engine.stats().decode_steps, 14]
        assert_bounds_hold(engine.cost, cfg, delivered, engine, replicas=2, slots=64)
    restarts = {w: sum(m["rollout/stale_restarts"] for m in ms) for w, ms in runs.items()}
    assert restarts[1.0] < restarts[0.0]
    assert sum(m["rollout/swapped_groups"] for m in runs[1.0]) > 0
    assert sum(m["rollout/swapped_groups"] for m in runs[0.0]) == 0


def test_member_refill_keeps_the_engine_full_where_group_counting_drains_it():
    """Group counting refills only when a group is dropped, so the engine drains as members finish;
    member refill starts a new group whenever a group's worth of requests has finished."""
    busy = {}
    for refill in ("groups", "members"):
        cfg = RolloutConfig(
            rollout_batch_size=4,
            n_samples_per_prompt=4,
            over_sampling_batch_size=8,
            max_response_len=2000,
            max_staleness=100,
            refill=refill,
            inflight="over_sampling",
        )
        april, engine, delivered = run_steps(cfg, 8, slots=64, length_scale=1 / 16)
        check_invariants(cfg, april, delivered)
        stats = engine.stats()
        busy[refill] = stats.busy_slot_steps / stats.decode_steps
    assert busy["members"] > 1.5 * busy["groups"]


def test_resumed_response_ends_where_an_uninterrupted_one_would():
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=8,
        max_response_len=100_000,
        max_staleness=100,
    )
    april, engine, delivered = run_steps(cfg, 10)
    resumed = [s for _, gs, _ in delivered for g in gs for s in g.samples if s.segments > 1]
    assert resumed
    for s in resumed:
        assert len(s.response_ids) == draw_length(1, f"{s.group_id}/{s.index}", 1 / 64)


def test_sync_baseline_never_aborts():
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=4,
        partial_rollout=False,
        max_response_len=300,
        max_staleness=2,
    )
    april, _, delivered = run_steps(cfg, 6)
    check_invariants(cfg, april, delivered)
    assert all(m["rollout/aborted"] == 0 and m["rollout/off_policy_token_frac"] == 0 for _, _, m in delivered)
    assert april.drawn == 6 * 4 and not april.dropped


def test_dynamic_sampling_filters_zero_variance_groups_and_refills():
    cfg = RolloutConfig(
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        over_sampling_batch_size=6,
        max_response_len=300,
        max_staleness=3,
        dynamic_sampling=True,
    )
    reward = lambda s, prompt: float(len(s.response_ids) % 2)  # equal in about half the groups
    april, _, delivered = run_steps(cfg, 8, reward)
    check_invariants(cfg, april, delivered)
    assert sum(m["reward/zero_std_groups"] for _, _, m in delivered) > 0
    assert "filtered" in april.dropped.values()
    for _, groups, _ in delivered:
        assert all(len({s.reward for s in g.samples}) > 1 for g in groups)


def test_buffer_and_state_round_trip_exactly():
    cfg = RolloutConfig(
        rollout_batch_size=4, n_samples_per_prompt=4, over_sampling_batch_size=8, max_response_len=300, max_staleness=2
    )
    april, _, _ = run_steps(cfg, 4)
    assert len(april.buffer) > 0
    state = json.loads(json.dumps(april.state_dict()))
    other = April(cfg, prompt_stream())
    other.load_state_dict(state)
    assert other.state_dict() == april.state_dict()
    assert other.buffer.summary() == april.buffer.summary() and april.buffer.summary()["partial_samples"] > 0


def test_eviction_counts_dropped_prompts():
    cfg = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        over_sampling_batch_size=8,
        max_response_len=300,
        max_staleness=5,
        buffer_capacity=2,
    )
    april, _, delivered = run_steps(cfg, 5)
    check_invariants(cfg, april, delivered)
    assert "evicted" in april.dropped.values()


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(over_sampling_batch_size=2, rollout_batch_size=4), "rollout.over_sampling_batch_size=2"),
        (dict(n_samples_per_prompt=0), "rollout.n_samples_per_prompt=0"),
        (dict(stale_policy="keep"), "rollout.stale_policy='keep'"),
        (dict(schedule="lifo"), "rollout.schedule='lifo'"),
        (dict(refill="tokens"), "rollout.refill='tokens'"),
        (dict(resume_count="half"), "rollout.resume_count='half'"),
        (dict(inflight="tokens"), "rollout.inflight='tokens'"),
        (dict(max_response_len=-1), "rollout.max_response_len=-1"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        RolloutConfig(**overrides).validate()


def test_short_first_orders_known_short_prompts_first():
    cfg = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4, schedule="short_first"
    )
    april = April(cfg, prompt_stream())
    groups = [april._new_group() for _ in range(3)]
    for g, length in zip(groups, (500, 20, 80)):
        for s in g.samples:
            s.response_ids = [1] * length
        april._remember_lengths(g)
    assert [g.group_id for g in april._ordered(groups)] == [groups[1].group_id, groups[2].group_id, groups[0].group_id]


# ---- the real engine: abort -> buffer -> resume gives the uninterrupted greedy tokens ----


@pytest.mark.slow
def test_jax_engine_abort_buffer_resume_matches_uninterrupted():
    model = qwen3.init_model(TINY_QWEN3.replace(initializer_range=0.3), seed=3)
    prompts = list(itertools.islice(prompt_stream(length=6, vocab=64, seed=4), 24))
    max_len = 40
    reference = JaxEngine(model, max_num_seqs=8, max_model_len=64).generate(
        [Request(p.uid, p.prompt_ids, max_len, SamplingParams(0.0)) for p in prompts]
    )
    # Stop tokens chosen from the outputs so responses end at very different lengths.
    counts = np.bincount(np.concatenate([r.token_ids for r in reference.values()]), minlength=64)
    stops = tuple(int(t) for t in np.argsort(counts)[-3:-1])

    def expected(uid):
        toks = reference[uid].token_ids
        cut = next((i for i, t in enumerate(toks) if t in stops), None)
        return toks if cut is None else toks[: cut + 1]

    lengths = [len(expected(p.uid)) for p in prompts]
    assert min(lengths) < 10 and max(lengths) == max_len

    cfg = RolloutConfig(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_batch_size=5,
        max_response_len=max_len,
        temperature=0.0,
        stop_token_ids=stops,
        max_staleness=100,
    )
    engine = JaxEngine(model, max_num_seqs=4, max_model_len=64)
    april = April(cfg, iter(prompts))
    delivered = []
    for step in range(6):
        groups, _ = april.collect(engine, version=step)
        delivered += groups
        engine.update_weights(model, step + 1)  # same weights, new version
    resumed = 0
    for g in delivered:
        for s in g.samples:
            assert s.response_ids == expected(g.prompt.uid), (g.prompt.uid, s.segments)
            resumed += s.segments > 1
    assert resumed > 0
