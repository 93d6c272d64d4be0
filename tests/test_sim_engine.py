"""The simulated engine under the roofline cost model: KV budget, preemption, parked KV, replicas."""

import dataclasses

import pytest

from april_jax.rollout import cost_model as cm
from april_jax.rollout.sim_engine import SimEngine, draw_length, length_key
from april_jax.rollout.sim_replicas import SimReplicas
from april_jax.rollout.types import Request


def small_gpu(budget_tokens: int) -> cm.Roofline:
    """The H200 / Qwen3-4B preset with just enough HBM for `budget_tokens` of KV."""
    base = cm.make("h200-qwen3-4b")
    hbm = (budget_tokens * base.kv_bytes_per_token + base.weight_bytes + base.activation_reserve_bytes) / base.mem_util
    cost = dataclasses.replace(base, hbm_bytes=hbm + 1.0)
    assert cost.kv_budget_tokens == budget_tokens
    return cost


def requests(group: str, n: int, prompt_len=16, max_new=10**6):
    return [
        Request(f"{group}/{i}/0/1", tuple(range(1, prompt_len + 1)), max_new, sample_key=f"{group}/{i}/0")
        for i in range(n)
    ]


def test_memory_pressure_preempts_and_keeps_kv_within_budget():
    engine = SimEngine(slots=64, seed=8, length_scale=1 / 16, cost=small_gpu(2000))
    reqs = [r for g in range(4) for r in requests(f"g{g}", 4)]
    out = engine.generate(reqs)
    stats = engine.stats()
    assert stats.preempted > 0 and stats.kv_tokens_peak <= 2000
    assert stats.kv_bytes_peak <= engine.cost.kv_budget_bytes
    for r in reqs:  # a preempted response is recomputed and still ends at its drawn length
        assert out[r.request_id].finish_reason == "stop"
        assert len(out[r.request_id].token_ids) == draw_length(8, length_key(r.sample_key), 1 / 16)


def test_a_request_that_can_never_fit_is_an_error_not_a_hang():
    engine = SimEngine(slots=4, seed=0, cost=small_gpu(100))
    (res,) = engine.generate([Request("big", tuple(range(1, 200)), 10)]).values()
    assert res.finish_reason == "error" and "KV budget" in res.error


@pytest.mark.parametrize("reuse", [False, True])
def test_abort_then_resume_reprefills_or_reuses_parked_kv(reuse):
    engine = SimEngine(slots=8, seed=1, cost=cm.make("h200-qwen3-4b"), reuse_aborted_kv=reuse)
    engine.submit(requests("g0", 2, max_new=40_000))
    for _ in range(3):
        engine.step()
    engine.submit(requests("g1", 1))  # a second group admitted mid-way: its prompt is prefilled
    engine.step()
    partial = {r.request_id: r for r in engine.abort_all()}
    before = engine.stats()
    assert before.parked_tokens == (sum(16 + len(r.token_ids) for r in partial.values()) if reuse else 0)
    assert before.kv_tokens_peak >= before.parked_tokens
    resumed = [
        Request(
            f"{rid}x",
            tuple(range(1, 17)) + tuple(r.token_ids),
            40_000 - len(r.token_ids),
            sample_key=rid.rsplit("/", 1)[0],
        )
        for rid, r in partial.items()
        if r.token_ids
    ]
    engine.submit(resumed)
    engine.step()
    after = engine.stats()
    new_prefill = after.prefill_tokens - before.prefill_tokens
    if reuse:
        assert new_prefill == 0 and after.kv_reused == len(resumed) and after.parked_tokens == 0
    else:
        # Each resume re-prefills its tokens; the group's prompt once (prefix cache within the group).
        groups = {r.sample_key.split("/")[0] for r in resumed}
        assert new_prefill == sum(len(r.prompt_ids) for r in resumed) - 16 * (len(resumed) - len(groups))


def test_replicas_keep_groups_whole_and_run_in_parallel():
    cost = cm.make("h200-qwen3-4b")
    one = SimReplicas(1, slots=16, cost=cost, seed=5, length_scale=1 / 32)
    one.generate(requests("g0", 4))
    four = SimReplicas(4, slots=16, cost=cost, seed=5, length_scale=1 / 32)
    out = four.generate([r for g in ("g0", "g1", "g2", "g3") for r in requests(g, 4)])
    assert len(out) == 16 and all(r.finish_reason == "stop" for r in out.values())
    assert sorted(four.route.values()) == [0, 1, 2, 3]  # one group per replica
    for g in ("g0", "g1", "g2", "g3"):
        replica = four.replicas[four.route[g]]
        assert replica.stats().tokens_generated == sum(draw_length(5, f"{g}/{i}", 1 / 32) for i in range(4))
    # In parallel: the set takes as long as its slowest replica, not the sum.
    slowest = max(r.now() for r in four.replicas)
    assert four.now() == pytest.approx(slowest)
    assert four.replicas[four.route["g0"]].now() == pytest.approx(one.now())
    assert slowest < sum(r.now() for r in four.replicas) / 2


def test_a_new_group_goes_to_the_replica_with_the_least_requests_counting_context():
    """Load = requests + running context / 16384: replica 0 runs one request of a 40,000-token context
    (1 + 40000 / 16384 = 3.44), replica 1 three of 16 tokens (3 + 48 / 16384 = 3.003), so a new group
    goes to replica 1, where counting requests alone (1 < 3) would send it to replica 0."""
    sim = SimReplicas(2, slots=8, seed=0)
    sim.route.update(big=0, small=1)
    sim.submit(requests("big", 1, prompt_len=40_000) + requests("small", 3))
    for r in sim.replicas:
        r.admit()
    assert [r.running_ctx for r in sim.replicas] == [40_000, 48]
    sim.submit(requests("new", 2))
    assert sim.route["new"] == 1


def test_abort_mid_span_counts_the_steps_done_by_then():
    cost = cm.make("h200-qwen3-4b")
    sim = SimReplicas(2, slots=8, cost=cost, seed=2, length_scale=1.0)
    sim.submit(requests("g0", 2, max_new=50) + requests("g1", 2, max_new=5000))
    first = []
    while not first:
        first = [r for r in sim.step() if r.finish_reason != "abort"]
    t = sim.now()
    partial = sim.abort_all()
    assert all(r.finish_reason == "abort" for r in partial)
    slow = sim.replicas[sim.route["g1"]]
    done = slow.stats().decode_steps
    # g1's replica ran the whole steps that ended by the time g0 finished, and not one more.
    assert 0 < done < 5000
    decode_time = t - cost.prefill_s(16)
    assert cost.decode_span_s(2, 2 * 16, done) <= decode_time < cost.decode_span_s(2, 2 * 16, done + 1)
    assert all(len(r.token_ids) == done for r in partial)


def test_a_restarted_response_is_regenerated_to_its_drawn_length_not_a_fresh_draw():
    """Attempts 0 and 1 of a member (a restart after the staleness cap) end at the length drawn for
    the member, so restarts do not shorten what is delivered; other members draw their own."""
    engine = SimEngine(slots=8, seed=7, cost=cm.make("h200-qwen3-4b"), length_scale=1 / 8)
    first = Request("g0/3/0/1", tuple(range(1, 17)), 10**6, sample_key="g0/3/0")
    again = Request("g0/3/1/1", tuple(range(1, 17)), 10**6, sample_key="g0/3/1")
    out = engine.generate([first, again])
    assert len(out[first.request_id].token_ids) == len(out[again.request_id].token_ids) == draw_length(7, "g0/3", 1 / 8)
    assert len({draw_length(7, f"g0/{i}", 1 / 8) for i in range(8)}) > 1


@pytest.mark.parametrize("deployment, sleeps", [("colocated", True), ("colocated", False), ("disaggregated", True)])
def test_the_train_step_costs_colocated_its_kv_and_a_sleep_and_disaggregated_nothing(deployment, sleeps):
    """An aborted response's KV is parked; across update_weights a colocated engine (asleep through
    the train step) loses it and pays sleep + wake + sync (0.2514 + 0.0179 s for Qwen3-4B), so the
    resume re-prefills its 16 + n tokens; a disaggregated one, or a colocated one that stays resident
    beside the trainer (sleeps=False, the plan's sleep level 0), pays the sync only and resumes from the KV."""
    cost = cm.make("h200-qwen3-4b")
    engine = SimEngine(slots=8, seed=1, cost=cost, deployment=deployment, sleeps=sleeps)
    engine.submit(requests("g0", 2, max_new=40_000))
    while not engine.step():  # until the shorter member finishes
        pass
    (partial,) = engine.abort_all()
    n = len(partial.token_ids)
    assert n > 0 and engine.stats().parked_tokens == 16 + n
    t = engine.now()
    engine.update_weights(None, 1)
    asleep = deployment == "colocated" and sleeps  # what loses the KV: the sleep
    assert engine.sleeps == asleep
    assert engine.now() - t == pytest.approx(cost.weight_sync_s() + (2 * cost.weight_bytes / 64e9 if asleep else 0))
    assert engine.stats().parked_tokens == (0 if asleep else 16 + n)
    assert engine.stats().kv_lost_in_sleep == (1 if asleep else 0)
    before = engine.stats().prefill_tokens
    key = partial.request_id.rsplit("/", 1)[0]
    engine.submit([Request(f"{key}/2", tuple(range(1, 17)) + tuple(partial.token_ids), 40_000 - n, sample_key=key)])
    engine.step()
    assert engine.stats().prefill_tokens - before == (16 + n if asleep else 0)
    assert engine.stats().kv_reused == (0 if asleep else 1)


def test_an_unknown_deployment_names_the_flag():
    with pytest.raises(ValueError, match="--deployment 'shared'"):
        SimEngine(deployment="shared")
