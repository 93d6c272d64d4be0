"""Embedded JAX engine against transformers generate and against teacher-forced logprobs; on a mesh
(its KV cache spread over the devices); the deployment plan's slots for it."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from april_jax.models import hf, sharding
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams
from engine_utils import GREEDY, transformers_greedy

SLOTS, MAX_LEN = 5, 96


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 160, size=rs.randint(1, 40)).tolist() for _ in range(16)]


def engine_for(model, **kw):
    return JaxEngine(
        model, max_num_seqs=kw.pop("max_num_seqs", SLOTS), max_model_len=kw.pop("max_model_len", MAX_LEN), **kw
    )


@pytest.fixture(scope="module")
def greedy_outputs(tiny_reference, prompts):
    _, model = tiny_reference
    engine = engine_for(model)
    out = engine.generate([Request(str(i), p, 32, GREEDY) for i, p in enumerate(prompts)])
    return out, engine.stats()


def teacher_forced_logprobs(model, prompt, response, temperature=1.0):
    logits = np.asarray(model(jnp.asarray([prompt + response], jnp.int32)))[0, len(prompt) - 1 : -1]
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return np.asarray(logp)[np.arange(len(response)), response]


def test_greedy_matches_transformers_generate(tiny_reference, prompts, greedy_outputs):
    ref, _ = tiny_reference
    out, stats = greedy_outputs
    assert len(prompts) > SLOTS and len({len(p) for p in prompts}) > 8
    for i, p in enumerate(prompts):
        assert out[str(i)].token_ids == transformers_greedy(ref, p, 32), f"prompt {i}"
        assert out[str(i)].finish_reason == "length"
    assert stats.tokens_generated == 16 * 32
    # Continuous batching: 16 requests through 5 slots kept the slots mostly busy.
    assert stats.occupancy > 0.75


def test_greedy_logprobs_equal_teacher_forced(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    for i in (0, 7, 15):
        r = out[str(i)]
        np.testing.assert_allclose(r.logprobs, teacher_forced_logprobs(model, prompts[i], r.token_ids), atol=1e-4)


@pytest.mark.slow
def test_sampled_logprobs_equal_teacher_forced_at_temperature(tiny_reference, prompts):
    _, model = tiny_reference
    engine = engine_for(model)
    for sp in (SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=2)):
        out = engine.generate([Request(str(i), prompts[i], 24, sp) for i in range(6)])
        for i in range(6):
            r = out[str(i)]
            expected = teacher_forced_logprobs(model, prompts[i], r.token_ids, sp.temperature)
            np.testing.assert_allclose(r.logprobs, expected, atol=1e-4)


def test_seeded_sampling_is_reproducible_across_slots_and_batches(tiny_reference, prompts):
    _, model = tiny_reference
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    alone = engine_for(model).generate([Request("x", prompts[3], 20, sp)])["x"].token_ids
    # Same request, now in another slot among other traffic.
    crowd = [Request(f"o{i}", prompts[i], 20, SamplingParams(1.0, seed=i)) for i in range(4)]
    crowded = engine_for(model).generate(crowd + [Request("x", prompts[3], 20, sp)])["x"].token_ids
    assert alone == crowded
    other = engine_for(model).generate([Request("x", prompts[3], 20, SamplingParams(1.0, top_p=0.95, seed=7))])
    assert other["x"].token_ids != alone


def test_top_k_one_is_greedy(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    got = engine_for(model).generate([Request("k", prompts[2], 32, SamplingParams(temperature=1.0, top_k=1, seed=5))])
    assert got["k"].token_ids == out["2"].token_ids


def test_stop_tokens_and_budgets_end_requests(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    full = out["4"].token_ids
    stop = full[10]
    first = full.index(stop)
    engine = engine_for(model)
    res = engine.generate(
        [
            Request("stop", prompts[4], 32, GREEDY, stop_token_ids=(stop,)),
            Request("budget", prompts[4], 7, GREEDY),
            Request("one", prompts[4], 1, GREEDY),
            Request("ctx", list(range(1, 91)), 32, GREEDY),  # 90-token prompt, max_model_len 96
        ]
    )
    assert res["stop"].token_ids == full[: first + 1] and res["stop"].finish_reason == "stop"
    assert res["budget"].token_ids == full[:7] and res["budget"].finish_reason == "length"
    assert res["one"].token_ids == full[:1] and res["one"].finish_reason == "length"
    assert len(res["ctx"].token_ids) == MAX_LEN - 90 and res["ctx"].finish_reason == "length"


def test_abort_returns_exact_partial_and_resume_completes(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    engine = engine_for(model, decode_steps_per_call=2)
    engine.submit([Request(str(i), prompts[i], 32, GREEDY) for i in range(8)])
    done = {}
    for _ in range(6):
        done.update({r.request_id: r for r in engine.step()})
    partial = {r.request_id: r for r in engine.abort_all()}
    assert not engine.has_unfinished()
    assert set(partial) | set(done) == {str(i) for i in range(8)}
    queued = [r for r in partial.values() if not r.token_ids]
    running = [r for r in partial.values() if r.token_ids]
    assert queued and running  # 8 requests in 5 slots: some never started
    for r in partial.values():
        assert r.finish_reason == "abort"
        n = len(r.token_ids)
        assert r.token_ids == out[r.request_id].token_ids[:n] and len(r.logprobs) == len(r.versions) == n
        np.testing.assert_allclose(r.logprobs, out[r.request_id].logprobs[:n], atol=1e-5)
    resumed = engine.generate(
        [
            Request(r.request_id, prompts[int(r.request_id)] + r.token_ids, 32 - len(r.token_ids), GREEDY)
            for r in partial.values()
        ]
    )
    for rid, r in partial.items():
        assert r.token_ids + resumed[rid].token_ids == out[rid].token_ids


def test_bad_requests_fail_alone(tiny_reference, prompts):
    _, model = tiny_reference
    engine = engine_for(model)
    res = engine.generate(
        [
            Request("empty", [], 8, GREEDY),
            Request("long", list(range(MAX_LEN)), 8, GREEDY),
            Request("zero", prompts[0], 0, GREEDY),
            Request("good", prompts[0], 8, GREEDY),
        ]
    )
    assert res["empty"].finish_reason == "error" and "'empty': empty prompt" in res["empty"].error
    assert "'long': prompt of 96 tokens" in res["long"].error and "max_model_len=96" in res["long"].error
    assert "'zero': max_new_tokens must be > 0" in res["zero"].error
    assert res["good"].finish_reason == "length" and len(res["good"].token_ids) == 8
    assert engine.stats().errors == 3


def test_update_weights_versions_tokens_and_changes_output(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    engine = engine_for(model, decode_steps_per_call=1)
    engine.submit([Request("a", prompts[5], 32, GREEDY)])
    for _ in range(5):
        engine.step()
    new_params = jax.tree.map(lambda x: x * 1.5, nnx.state(model))
    engine.update_weights(new_params, version=1)
    res = list(engine.run())[0]
    assert res.versions[:6] == [0] * 6 and set(res.versions[6:]) == {1}
    assert res.token_ids[:6] == out["5"].token_ids[:6]

    changed = nnx.merge(nnx.graphdef(model), new_params)
    fresh = engine_for(changed).generate([Request("b", prompts[5], 32, GREEDY)])["b"]
    after = engine.generate([Request("b", prompts[5], 32, GREEDY)])["b"]
    assert after.token_ids == fresh.token_ids != out["5"].token_ids
    assert after.versions == [1] * 32 and engine.policy_version == 1


def test_batched_refill_gives_the_same_tokens(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    engine = engine_for(model, min_prefill_batch=3)
    got = engine.generate([Request(str(i), p, 32, GREEDY) for i, p in enumerate(prompts)])
    assert all(got[str(i)].token_ids == out[str(i)].token_ids for i in range(len(prompts)))
    assert engine.stats().prefill_tokens == sum(map(len, prompts))


def test_multi_step_decode_gives_the_same_results_as_single_steps(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    stop = out["4"].token_ids[10]
    requests = [Request(f"g{i}", p, 32, GREEDY, stop_token_ids=(stop,)) for i, p in enumerate(prompts)]
    requests += [
        Request(f"s{i}", p, 3 + 5 * i, SamplingParams(1.0, top_p=0.9, seed=i), stop_token_ids=(7, 9, 11))
        for i, p in enumerate(prompts[:6])
    ]
    requests.append(Request("ctx", list(range(1, 91)), 32, GREEDY))  # ends at max_model_len mid-call
    single = engine_for(model, decode_steps_per_call=1).generate(requests)
    multi_engine = engine_for(model, decode_steps_per_call=8)
    multi = multi_engine.generate(requests)
    assert any(r.finish_reason == "stop" for r in single.values())
    for rid, r in single.items():
        m = multi[rid]
        assert (m.token_ids, m.finish_reason) == (r.token_ids, r.finish_reason), rid
        np.testing.assert_allclose(m.logprobs, r.logprobs, atol=1e-5)
    stats = multi_engine.stats()
    assert stats.tokens_generated == sum(len(r.token_ids) for r in single.values())
    assert stats.decode_calls * 3 < stats.decode_steps


def test_requests_with_the_same_prompt_share_one_prefill(tiny_reference, prompts):
    _, model = tiny_reference
    requests = [
        Request(f"{g}-{j}", prompts[g], 16, SamplingParams(1.0, seed=10 * g + j)) for g in range(3) for j in range(4)
    ]
    engine = engine_for(model, max_num_seqs=12, samples_per_prompt=4)
    shared = engine.generate(requests)
    assert engine.stats().prefill_tokens == sum(len(prompts[g]) for g in range(3))
    assert len({tuple(shared[f"0-{j}"].token_ids) for j in range(4)}) > 1  # own keys, not copies
    alone_engine = engine_for(model)
    for request in requests:
        alone = alone_engine.generate([request])[request.request_id]
        assert shared[request.request_id].token_ids == alone.token_ids
        np.testing.assert_allclose(shared[request.request_id].logprobs, alone.logprobs, atol=1e-5)


def test_reused_aborted_kv_resumes_exactly_like_an_uninterrupted_run(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    engine = engine_for(model, reuse_aborted_kv=True, decode_steps_per_call=2)
    engine.submit([Request(str(i), prompts[i], 32, GREEDY) for i in range(8)])
    for _ in range(4):
        engine.step()
    partial = {r.request_id: r for r in engine.abort_all() if r.token_ids}
    assert len(partial) == SLOTS and engine.stats().kv_parked == SLOTS
    resumed = engine.generate(
        [Request(rid, prompts[int(rid)] + r.token_ids, 32 - len(r.token_ids), GREEDY) for rid, r in partial.items()]
    )
    stats = engine.stats()
    assert stats.kv_reused == SLOTS
    assert stats.prefill_tokens == sum(len(prompts[i]) for i in range(SLOTS))  # no re-prefill
    for rid, r in partial.items():
        assert r.token_ids + resumed[rid].token_ids == out[rid].token_ids
        np.testing.assert_allclose(r.logprobs + resumed[rid].logprobs, out[rid].logprobs, atol=1e-5)
    # A prompt that only shares a prefix with a parked row is prefilled, not matched.
    engine.submit([Request("x", prompts[0], 8, GREEDY)])
    for _ in range(2):
        engine.step()
    engine.abort_all()
    assert engine.generate([Request("y", prompts[0], 8, GREEDY)])["y"].token_ids == out["0"].token_ids[:8]
    assert engine.stats().kv_reused == SLOTS


def test_sleep_frees_the_kv_cache_and_parked_rows_survive_it(tiny_reference, prompts, greedy_outputs):
    _, model = tiny_reference
    out, _ = greedy_outputs
    engine = engine_for(model, reuse_aborted_kv=True, decode_steps_per_call=2)
    engine.submit([Request(str(i), prompts[i], 32, GREEDY) for i in range(SLOTS)])
    engine.step()
    with pytest.raises(RuntimeError, match="requests still in flight"):
        engine.sleep()
    engine.step()
    partial = {r.request_id: r for r in engine.abort_all()}
    cache = engine._cache
    engine.sleep()  # between rollouts, as the trainer steps
    assert engine.stats().kv_cache_bytes == 0 and all(x.is_deleted() for x in jax.tree.leaves(cache))
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake_up()
    assert engine.stats().kv_cache_bytes == sum(x.nbytes for x in jax.tree.leaves(cache))
    resumed = engine.generate(
        [Request(rid, prompts[int(rid)] + r.token_ids, 32 - len(r.token_ids), GREEDY) for rid, r in partial.items()]
    )
    assert engine.stats().kv_reused == SLOTS  # the parked rows came back from host memory
    for rid, r in partial.items():
        assert r.token_ids + resumed[rid].token_ids == out[rid].token_ids
    kept = engine_for(model, free_kv_in_sleep=False)
    kept.sleep()
    assert kept.stats().kv_cache_bytes > 0  # off: sleep keeps the cache


@pytest.mark.slow  # prompts of up to a few hundred tokens through transformers and every prefill block: ~15-20 s
def test_long_prompts_prefill_by_causal_blocks_and_match_transformers(tiny_reference):
    """Prompts of 150-250 tokens prefill in buckets of 256 (4 query blocks, the masked ones skipped)."""
    ref, model = tiny_reference
    rs = np.random.RandomState(5)
    long_prompts = [rs.randint(0, 160, size=n).tolist() for n in (150, 200, 250)]
    engine = engine_for(model, max_num_seqs=2, max_model_len=300)
    out = engine.generate([Request(str(i), p, 12, GREEDY) for i, p in enumerate(long_prompts)])
    for i, p in enumerate(long_prompts):
        assert out[str(i)].token_ids == transformers_greedy(ref, p, 12), f"prompt {i}"
        np.testing.assert_allclose(
            out[str(i)].logprobs, teacher_forced_logprobs(model, p, out[str(i)].token_ids), atol=1e-4
        )


@pytest.mark.parametrize(
    "cache_dtype,slots",
    [  # a bf16 model over SLOTS rows compiles slowly on CPU: ~15-20 s each on 2 cores
        pytest.param(None, SLOTS, marks=pytest.mark.slow),
        pytest.param(jnp.bfloat16, SLOTS, marks=pytest.mark.slow),
        (None, 1),
    ],
)
def test_bf16_engine_logprobs_match_bf16_teacher_forcing(tiny_hf_checkpoint, prompts, cache_dtype, slots):
    """A bf16 model: the engine's logprobs against the same bf16 model's full forward. They differ
    by bf16 rounding only (keys and values are held exactly: the default cache on CPU is fp32, the
    GPU default is bf16; one slot takes the single-row matmul path); measured max |diff| 0.002
    nats, asserted 0.02."""
    model = hf.from_pretrained(tiny_hf_checkpoint[0], dtype=jnp.bfloat16)
    engine = engine_for(model, cache_dtype=cache_dtype, max_num_seqs=slots)
    expected_cache = jnp.float32 if cache_dtype is None and jax.default_backend() == "cpu" else jnp.bfloat16
    assert engine._cache.k[0].dtype == expected_cache
    out = engine.generate([Request(str(i), prompts[i], 24, GREEDY) for i in range(4)])
    worst = 0.0
    for i in range(4):
        r = out[str(i)]
        expected = teacher_forced_logprobs(model, prompts[i], r.token_ids)
        worst = max(worst, float(np.max(np.abs(np.asarray(r.logprobs) - expected))))
    assert worst < 0.02, worst


def test_timeline_keeps_only_its_latest_points(tiny_reference, prompts):
    """One (time, busy slots) point per decode step, bounded: a long run keeps the newest only."""
    _, model = tiny_reference
    engine = engine_for(model, timeline_points=8)
    engine.generate([Request("t", prompts[0], 40, GREEDY)])
    assert engine.stats().decode_steps == 39 > len(engine.timeline) == 8  # the first token is the prefill's
    times = [t for t, _ in engine.timeline]
    assert times == sorted(times) and times[-1] <= engine.now()
    assert [busy for _, busy in engine.timeline] == [1] * 8


def test_kv_budget_is_every_slot_at_full_length(tiny_reference):
    _, model = tiny_reference
    assert engine_for(model, max_num_seqs=7, max_model_len=40).kv_budget_tokens == 7 * 40


@pytest.mark.slow  # compiles the engine's programs for an 8-device mesh: ~45 s on 2 busy cores
def test_a_mesh_engine_spreads_its_slots_over_the_devices_and_generates_the_one_device_tokens(
    tiny_hf_checkpoint, prompts, greedy_outputs
):
    """8 devices (conftest.py): the cache's slots split over data x fsdp (4 ways) and its 2 KV
    heads over tensor, on the same layout through prefill, shared prompts, decode, an abort, the
    resumed members' extend and sleep; greedy tokens equal the one-device engine's."""
    path, _ = tiny_hf_checkpoint
    out, _ = greedy_outputs
    model = hf.from_pretrained(path, mesh=sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    engine = engine_for(
        model, max_num_seqs=8, samples_per_prompt=2, decode_steps_per_call=2, smallest_prefill_bucket=64
    )  # one prompt bucket below MAX_LEN: fewer programs to compile on the mesh
    layout = lambda: [x.sharding for x in jax.tree.leaves(engine._cache)]
    placed = layout()
    keys = engine._cache.k[0]
    assert keys.sharding.spec == P(("data", "fsdp"), "tensor")
    assert {x.data.shape for x in keys.addressable_shards} == {(2, 1, *keys.shape[2:])}  # a quarter of the slots
    assert engine._cache.lengths_B.sharding.spec == P(("data", "fsdp"))

    # two members per prompt (one shared prefill), aborted part way
    members = [(f"{i}/{j}", i) for i in range(6) for j in range(2)]
    engine.submit([Request(rid, prompts[i], 32, GREEDY) for rid, i in members])
    for _ in range(4):
        engine.step()
    partial = {r.request_id: r for r in engine.abort_all()}
    assert any(r.token_ids for r in partial.values()) and layout() == placed
    # resumed: the group's prompt prefilled once, each member's partial response extended
    resumed = engine.generate(
        [
            Request(
                rid,
                prompts[i] + partial[rid].token_ids,
                32 - len(partial[rid].token_ids),
                GREEDY,
                shared_prefix_len=len(prompts[i]),
            )
            for rid, i in members
        ]
    )
    for rid, i in members:
        assert partial[rid].token_ids + resumed[rid].token_ids == out[str(i)].token_ids, rid
    assert layout() == placed
    engine.sleep()
    engine.wake_up()
    assert layout() == placed
    engine.submit([Request("6", prompts[6], 32, GREEDY)])
    engine.step()
    # "6b" starts from a copy of its busy sibling's prompt row
    rest = engine.generate(
        [Request("6b", prompts[6], 32, GREEDY)] + [Request(str(i), prompts[i], 32, GREEDY) for i in range(7, 16)]
    )
    assert engine.stats().prompt_copies == 1
    assert rest.pop("6b").token_ids == out["6"].token_ids
    assert {rid: r.token_ids for rid, r in rest.items()} == {str(i): out[str(i)].token_ids for i in range(6, 16)}
    assert layout() == placed


def plan_of(name, spec, *overrides):
    from april_jax.config.loading import load_config
    from april_jax.training.devices import parse_spec
    from april_jax.training.plan import make_plan

    config = Path(__file__).resolve().parents[1] / "configs" / name
    return make_plan(load_config(["train", "--config", str(config), *overrides]), parse_spec(spec))


def test_plan_slots_fit_the_cache_share_and_a_whole_working_set_a_device():
    """Qwen3-4B at 17,408 positions on 8 H100s: a slot's row is 2.57 GB; each device holds 1/8 of
    the slots' rows and, in a device call, up to twice every slot's row whole."""
    plan = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.engine=jax")
    tb, j = plan.trainer["bytes_per_device"], plan.rollout["jax_engine"]
    row = 17_408 * 147_456
    # JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 of the device) less what the trainer keeps
    # through a rollout with the optimizer state on the host (auto: the plan needs the room)
    room = 0.90 * 80e9 - (tb["parameters"] + tb["runtime"] + tb["xla_margin"] + tb["gathered_weights"])
    need = lambda slots: row * (slots // 8 + 2 * slots)
    assert plan.trainer["offload"] is True and plan.trainer["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    assert need(8) <= room < need(16) and j["slots_that_fit"] == 8 and j["slot_shards"] == 8
    assert any("rollout.max_num_seqs=512" in p and "<=8" in p for p in plan.problems), plan.problems
    # 12 slots do not divide the 8 devices: every device would hold all 12 rows
    odd = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.engine=jax", "--config.rollout.max_num_seqs=12")
    assert not odd.fits and f"need {row * (12 + 2 * 12) / 1e9:.1f} GB a device" in odd.problems[0]
    ok = plan_of("qwen3_4b.py", "8xH100-80GB", "--config.rollout.engine=jax", "--config.rollout.max_num_seqs=8")
    assert ok.fits and ok.rollout["jax_engine"]["kv_cache_bytes_per_device"] == row


def test_plan_counts_the_fp32_cache_of_a_cpu_host():
    plan = plan_of("tiny.py", "1xCPU-24GB", "--config.model.compute_dtype=bfloat16")
    j, m = plan.rollout["jax_engine"], plan.model
    assert plan.fits and j["slots"] == 128 and plan.trainer["offload"] is False
    assert j["kv_cache_bytes_per_device"] == 128 * m["max_model_len"] * m["kv_bytes_per_token"] * 2  # bf16 -> fp32
