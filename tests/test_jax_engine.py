"""Embedded JAX engine against transformers generate and against teacher-forced logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from april_jax.models import hf
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
