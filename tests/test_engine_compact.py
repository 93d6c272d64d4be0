"""The JAX engine's cost follows its work: decode over the busy slots only (batch and cache length
buckets), and a group's resumed members prefill their shared prompt once. Each against the
full-batch path, separate prefills, and transformers greedy."""

import numpy as np
import pytest

from april_jax.rollout import engine_steps, held_kv
from april_jax.rollout.jax_engine import JaxEngine, merge_buckets
from april_jax.rollout.types import Request, SamplingParams
from engine_utils import GREEDY, transformers_greedy

SLOTS, MAX_LEN = 16, 160


@pytest.fixture(scope="module")
def workload():
    """Greedy and sampled requests whose budgets (3..60 tokens) leave fewer and fewer slots busy,
    with prompts of 1..70 tokens so contexts cross the 64-position length bucket."""
    rs = np.random.RandomState(1)
    requests = []
    for i in range(24):
        prompt = rs.randint(0, 160, size=rs.randint(1, 70)).tolist()
        sampling = GREEDY if i % 2 == 0 else SamplingParams(1.0, top_p=0.9 if i % 4 == 1 else 1.0, seed=i)
        requests.append(Request(str(i), prompt, int(rs.randint(3, 60)), sampling))
    return requests


def run(model, requests, **kw):
    engine = JaxEngine(model, max_num_seqs=SLOTS, max_model_len=MAX_LEN, decode_steps_per_call=4, **kw)
    return engine.generate(requests), engine.stats()


@pytest.fixture(scope="module")
def compact_and_full(tiny_reference, workload):
    _, model = tiny_reference
    before = engine_steps.TRACES["decode"]
    compact = run(model, workload)
    traces = engine_steps.TRACES["decode"] - before
    return compact, run(model, workload, compact_decode=False), traces


def test_compacted_decode_equals_the_full_batch_path(compact_and_full, workload):
    (compact, compact_stats), (full, full_stats), _ = compact_and_full
    for r in workload:
        c, f = compact[r.request_id], full[r.request_id]
        assert (c.token_ids, c.finish_reason) == (f.token_ids, f.finish_reason), r.request_id
        np.testing.assert_allclose(c.logprobs, f.logprobs, atol=1e-5)
        assert len(c.token_ids) == r.max_new_tokens
    assert compact_stats.tokens_generated == full_stats.tokens_generated
    # The same work, computed over far fewer slot-steps (the tail runs with a few busy slots).
    assert compact_stats.computed_slot_steps < 0.8 * full_stats.computed_slot_steps
    assert full_stats.computed_slot_steps == full_stats.decode_steps * SLOTS


def test_compacted_greedy_decode_matches_transformers(tiny_reference, compact_and_full, workload):
    ref, _ = tiny_reference
    (compact, _), _, _ = compact_and_full
    for r in workload[::2][:6]:
        assert compact[r.request_id].token_ids == transformers_greedy(ref, r.prompt_ids, r.max_new_tokens), r.request_id


def test_bucketed_batches_compile_once_per_bucket(tiny_reference, compact_and_full, workload):
    """Busy counts 16 -> 1 and contexts 2 -> 130 over the run: decode compiled at most once per
    (batch bucket {4, 8, 16}, length bucket {64, 128, 160}, mode), and a second run compiles nothing."""
    _, model = tiny_reference
    _, _, traces = compact_and_full
    assert 0 < traces <= 3 * 3 * 3
    before = engine_steps.TRACES["decode"]
    again, _ = run(model, list(reversed(workload)))  # other busy counts at each step, same buckets
    assert engine_steps.TRACES["decode"] == before
    assert again[workload[0].request_id].token_ids == compact_and_full[0][0][workload[0].request_id].token_ids


@pytest.fixture(scope="module")
def resumed_groups(tiny_reference):
    """Two groups of 4; each member cut after 0..9 tokens of its own seeded continuation, as APRIL
    aborts and resumes them (prompt + partial, a fresh request with the group's prompt as prefix)."""
    _, model = tiny_reference
    rs = np.random.RandomState(2)
    prompts = [rs.randint(0, 160, size=n).tolist() for n in (21, 40)]
    full = {}
    for g, prompt in enumerate(prompts):
        requests = [Request(f"{g}/{j}", prompt, 24, SamplingParams(1.0, seed=100 * g + j)) for j in range(4)]
        full.update(run(model, requests)[0])
    cut = {rid: [0, 3, 5, 9][int(rid[-1])] for rid in full}
    return prompts, full, cut


def resume(prompts, full, cut, shared: bool, seed_offset=1):
    out = []
    for rid, r in full.items():
        prompt, n = prompts[int(rid[0])], cut[rid]
        out.append(
            Request(
                rid,
                prompt + r.token_ids[:n],
                24 - n,
                SamplingParams(1.0, seed=seed_offset + hash(rid) % 997),
                shared_prefix_len=len(prompt) if shared else 0,
            )
        )
    return out


def test_resumed_members_share_one_prompt_prefill(tiny_reference, resumed_groups):
    _, model = tiny_reference
    prompts, full, cut = resumed_groups
    shared, shared_stats = run(model, resume(prompts, full, cut, shared=True), samples_per_prompt=4)
    separate, separate_stats = run(model, resume(prompts, full, cut, shared=False), samples_per_prompt=4)
    for rid in full:
        assert shared[rid].token_ids == separate[rid].token_ids, rid
        np.testing.assert_allclose(shared[rid].logprobs, separate[rid].logprobs, atol=1e-5)
    partial_tokens = sum(cut.values())
    assert shared_stats.prefill_tokens == sum(map(len, prompts)) + partial_tokens
    assert separate_stats.prefill_tokens == 4 * sum(map(len, prompts)) + partial_tokens


def test_members_started_after_their_siblings_copy_the_prompt_instead_of_prefilling(tiny_reference):
    """Four slots, two groups of four with budgets that end at different steps: later members
    start while a sibling still runs, copy its prompt's KV and decode from the prompt's last
    token. Same tokens (greedy and seeded sampling) and logprobs as prefilling every prompt,
    and transformers' greedy tokens."""
    ref, model = tiny_reference
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, 160, size=n).tolist() for n in (23, 41)]
    requests = [
        Request(f"{g}/{j}", p, [5, 30, 12, 20][j], GREEDY if j % 2 == 0 else SamplingParams(1.0, seed=10 * g + j))
        for g, p in enumerate(prompts)
        for j in range(4)
    ]
    out = {}
    for copy in (True, False):
        engine = JaxEngine(model, max_num_seqs=4, max_model_len=MAX_LEN, decode_steps_per_call=4, copy_prompt_kv=copy)
        out[copy] = engine.generate(requests), engine.stats()
    (copied, copied_stats), (prefilled, prefilled_stats) = out[True], out[False]
    for r in requests:
        assert copied[r.request_id].token_ids == prefilled[r.request_id].token_ids, r.request_id
        np.testing.assert_allclose(copied[r.request_id].logprobs, prefilled[r.request_id].logprobs, atol=1e-5)
    for r in requests[::2]:
        assert copied[r.request_id].token_ids == transformers_greedy(ref, r.prompt_ids, r.max_new_tokens), r.request_id
    assert copied_stats.prompt_copies >= 2 and prefilled_stats.prompt_copies == 0
    assert copied_stats.tokens_generated == prefilled_stats.tokens_generated
    # each copy is a prompt not prefilled (every prompt of a group has one length)
    saved = prefilled_stats.prefill_tokens - copied_stats.prefill_tokens
    assert saved >= copied_stats.prompt_copies * min(map(len, prompts)) > 0


def test_a_prompt_is_copied_only_from_a_row_the_current_weights_computed(tiny_reference):
    """A held row's prompt KV serves a sibling that starts later, until a weight update: then the
    sibling prefills (vLLM likewise resets its prefix cache when the weights change)."""
    _, model = tiny_reference
    prompt = list(range(3, 40))
    copies = {}
    for update in (False, True):
        engine = JaxEngine(model, max_num_seqs=4, max_model_len=MAX_LEN, hold_aborted_kv=True)
        engine.submit([Request("first", prompt, 30, GREEDY)])
        engine.step()
        assert [r.finish_reason for r in engine.abort_all()] == ["abort"]  # its row is held
        if update:
            engine.update_weights(engine._state, engine.policy_version + 1)
        engine.generate([Request("later", prompt, 4, GREEDY)])
        copies[update] = engine.stats().prompt_copies
    assert copies == {False: 1, True: 0}


def test_greedy_resume_from_a_shared_prefix_continues_the_uninterrupted_run(tiny_reference, resumed_groups):
    ref, model = tiny_reference
    prompts, _, cut = resumed_groups
    uninterrupted = {g: run(model, [Request("x", p, 24, GREEDY)])[0]["x"] for g, p in enumerate(prompts)}
    requests = [
        Request(
            f"{g}/{j}",
            p + uninterrupted[g].token_ids[: cut[f"{g}/{j}"]],
            24 - cut[f"{g}/{j}"],
            GREEDY,
            shared_prefix_len=len(p),
        )
        for g, p in enumerate(prompts)
        for j in range(4)
    ]
    out, _ = run(model, requests, samples_per_prompt=4)
    for g in range(len(prompts)):
        for j in range(4):
            n = cut[f"{g}/{j}"]
            got = out[f"{g}/{j}"]
            assert uninterrupted[g].token_ids[:n] + got.token_ids == uninterrupted[g].token_ids
            np.testing.assert_allclose(got.logprobs, uninterrupted[g].logprobs[n:], atol=1e-5)


def test_merge_buckets_joins_a_bucket_to_the_next_when_the_padding_fits():
    by_bucket = {32: ["d"], 8: ["a", "b"], 16: ["c"]}
    assert merge_buckets(by_bucket, len, 0) == {8: ["a", "b"], 16: ["c"], 32: ["d"]}
    # 8 -> 16 pads 2 rows x 8 = 16 tokens: fits; 16 -> 32 would pad 3 x 16 = 48
    assert merge_buckets(by_bucket, len, 16) == {16: ["a", "b", "c"], 32: ["d"]}
    assert merge_buckets(by_bucket, len, 48) == {32: ["a", "b", "c", "d"]}


def test_merged_length_buckets_give_the_same_tokens_in_fewer_calls(tiny_reference, resumed_groups, workload):
    """Prompts of 21 and 40 tokens (prefill buckets 32 and 64) and partials of 0-9 tokens (extend
    buckets 8 and 16): one call per bucket, or one for all."""
    _, model = tiny_reference
    prompts, full, cut = resumed_groups
    for requests in (resume(prompts, full, cut, shared=True), workload):
        apart, apart_stats = run(model, requests, samples_per_prompt=4)
        merged, merged_stats = run(model, requests, samples_per_prompt=4, merge_padding_tokens=10_000)
        for r in requests:
            assert merged[r.request_id].token_ids == apart[r.request_id].token_ids, r.request_id
            np.testing.assert_allclose(merged[r.request_id].logprobs, apart[r.request_id].logprobs, atol=1e-5)
        assert merged_stats.model_calls < apart_stats.model_calls


def cut_and_abort(engine, prompts, steps: int):
    """Submit 4 members per prompt (group 0 greedy: identical partials; group 1 seeded), run `steps`
    engine steps, abort everything: the partial results by request id."""
    requests = [
        Request(f"{g}/{j}", prompt, 24, GREEDY if g == 0 else SamplingParams(1.0, seed=10 * g + j))
        for g, prompt in enumerate(prompts)
        for j in range(4)
    ]
    engine.submit(requests)
    for _ in range(steps):
        engine.step()
    return {r.request_id: r for r in engine.abort_all()}


def resumed(prompts, partials):
    """APRIL's resume of each aborted member: prompt + partial, the group's prompt as shared prefix."""
    return [
        Request(
            rid + "+",
            prompts[int(rid[0])] + r.token_ids,
            24 - len(r.token_ids),
            GREEDY if rid[0] == "0" else SamplingParams(1.0, seed=1000 + int(rid[-1])),
            shared_prefix_len=len(prompts[int(rid[0])]),
        )
        for rid, r in sorted(partials.items())
    ]


def test_held_rows_resume_in_their_slots_as_a_reprefill_would(tiny_reference, resumed_groups):
    """hold_aborted_kv: an aborted row stays in its slot and the resumed request continues there,
    no prefill at all (identical greedy partials each keep their own row); tokens and logprobs
    equal a fresh engine's re-prefill of prompt + partial."""
    _, model = tiny_reference
    prompts, _, _ = resumed_groups
    engine = JaxEngine(
        model,
        max_num_seqs=SLOTS,
        max_model_len=MAX_LEN,
        decode_steps_per_call=4,
        hold_aborted_kv=True,
        samples_per_prompt=4,
    )
    partials = cut_and_abort(engine, prompts, steps=2)
    assert all(0 < len(r.token_ids) < 24 for r in partials.values())
    assert len({tuple(partials[f"0/{j}"].token_ids) for j in range(4)}) == 1  # greedy: identical partials
    before = engine.stats()
    held = engine.generate(resumed(prompts, partials))
    after = engine.stats()
    assert after.kv_reused - before.kv_reused == 8 and after.prefill_tokens == before.prefill_tokens
    reprefilled, stats = run(model, resumed(prompts, partials), samples_per_prompt=4)
    assert stats.prefill_tokens == sum(map(len, prompts)) + sum(len(r.token_ids) for r in partials.values())
    for rid, r in held.items():
        assert r.token_ids == reprefilled[rid].token_ids, rid
        np.testing.assert_allclose(r.logprobs, reprefilled[rid].logprobs, atol=1e-4)


def test_held_rows_give_way_to_new_requests_oldest_first(tiny_reference, resumed_groups):
    """8 slots all held, 3 new requests: the 3 oldest held rows are freed; of the resumed members,
    the 5 still held continue in place and the 3 evicted re-prefill, with the same tokens."""
    _, model = tiny_reference
    prompts, _, _ = resumed_groups
    engine = JaxEngine(
        model,
        max_num_seqs=8,
        max_model_len=MAX_LEN,
        decode_steps_per_call=4,
        hold_aborted_kv=True,
        samples_per_prompt=4,
    )
    partials = cut_and_abort(engine, prompts, steps=2)
    oldest = sorted(engine._held_order)[:3]  # aborted together: in slot order
    engine.generate([Request(f"new{i}", [5, 6, 7], 4, GREEDY) for i in range(3)])
    stats = engine.stats()
    assert stats.kv_evicted == 3 and not any(slot in engine._held_order for slot in oldest)
    out = engine.generate(resumed(prompts, partials))
    assert engine.stats().kv_reused == 5
    reference, _ = run(model, resumed(prompts, partials), samples_per_prompt=4)
    for rid, r in out.items():
        assert r.token_ids == reference[rid].token_ids, rid
        np.testing.assert_allclose(r.logprobs, reference[rid].logprobs, atol=1e-4)


def test_held_rows_saved_as_json_resume_bit_for_bit_in_a_fresh_engine(tiny_reference, resumed_groups):
    """The held rows through JSON into a fresh engine (a run resumed from a stop signal's
    checkpoint): the resumed requests continue in the same slots without a prefill, and their
    tokens and logprobs equal the original engine's exactly; a state that does not fit (another
    slot count, torn bytes) is refused with a reason and nothing held."""
    import json

    _, model = tiny_reference
    prompts, _, _ = resumed_groups
    make = lambda slots=SLOTS: JaxEngine(
        model,
        max_num_seqs=slots,
        max_model_len=MAX_LEN,
        decode_steps_per_call=4,
        hold_aborted_kv=True,
        samples_per_prompt=4,
        seed=3,
    )
    engine = make()
    partials = cut_and_abort(engine, prompts, steps=2)
    state = json.loads(json.dumps(held_kv.to_json(engine.held_kv_snapshot())))
    assert sorted(state["slots"]) == sorted(engine._held_order) and len(state["slots"]) == 8
    rng = engine.rng_state()
    want = engine.generate(resumed(prompts, partials))

    fresh = make()
    fresh.set_rng_state(rng)
    assert fresh.restore_held_kv(state) is None
    got = fresh.generate(resumed(prompts, partials))
    stats = fresh.stats()
    assert stats.kv_reused == 8 and stats.prefill_tokens == 0
    for rid, r in want.items():
        assert got[rid].token_ids == r.token_ids, rid
        assert got[rid].logprobs == r.logprobs, rid

    small = make(slots=4)
    assert "do not fit" in small.restore_held_kv(state) and not small._held_order
    torn = dict(state, k=[dict(state["k"][0], data=state["k"][0]["data"][:-8])] + state["k"][1:])
    fresh = make()
    assert "unreadable" in fresh.restore_held_kv(torn) and not fresh._held_order


def test_decode_runs_in_place_when_every_slot_is_in_the_call(tiny_reference, workload):
    """With all 16 slots busy and a long context the decode program works on the cache where it
    lies (no row gather, no scatter back); its tokens equal the full-batch reference path."""
    _, model = tiny_reference
    engine = JaxEngine(model, max_num_seqs=SLOTS, max_model_len=MAX_LEN, decode_steps_per_call=4)
    calls = []
    decode = engine._programs.decode

    def spy(*args, **kw):
        calls.append(kw["in_place"])
        return decode(*args, **kw)

    engine._programs = engine._programs._replace(decode=spy)
    requests = workload[:SLOTS]
    out = engine.generate(requests)
    assert True in calls and False in calls  # in place while all are busy, compacted in the tail
    reference, _ = run(model, requests, compact_decode=False)
    for r in requests:
        assert out[r.request_id].token_ids == reference[r.request_id].token_ids, r.request_id
        np.testing.assert_allclose(out[r.request_id].logprobs, reference[r.request_id].logprobs, atol=1e-5)


def test_hold_and_side_cache_parking_are_exclusive(tiny_reference):
    _, model = tiny_reference
    with pytest.raises(ValueError, match="hold_aborted_kv"):
        JaxEngine(model, max_num_seqs=4, max_model_len=32, reuse_aborted_kv=True, hold_aborted_kv=True)


def recording_prefill_lengths(engine, seen: set):
    """A stand-in for `engine._device` that adds each prefill call's prompt-token length to `seen`."""
    device = engine._device

    def spy(program, *args, **kw):
        if program is engine._programs.prefill:
            seen.add(args[5].shape[1])
        return device(program, *args, **kw)

    return spy


def test_a_larger_smallest_prefill_bucket_pads_prompts_and_keeps_tokens(tiny_reference, workload):
    """`smallest_prefill_bucket=64`: prompts of 1-70 tokens prefill in buckets 64 and 128 only (fewer
    programs to compile), with the same tokens and logprobs as the default 16-token buckets."""
    _, model = tiny_reference
    shapes = {}
    for smallest in (16, 64):
        engine = JaxEngine(
            model, max_num_seqs=SLOTS, max_model_len=MAX_LEN, decode_steps_per_call=4, smallest_prefill_bucket=smallest
        )
        seen = set()
        engine._device = recording_prefill_lengths(engine, seen)
        shapes[smallest] = (engine.generate(workload), seen)
    (small, small_lengths), (large, large_lengths) = shapes[16], shapes[64]
    assert min(small_lengths) < 64 and large_lengths <= {64, 128}
    for r in workload:
        assert large[r.request_id].token_ids == small[r.request_id].token_ids, r.request_id
        np.testing.assert_allclose(large[r.request_id].logprobs, small[r.request_id].logprobs, atol=1e-5)


@pytest.mark.slow  # compiles every bucket program: ~20-40 s on 2 cores
def test_warmup_leaves_nothing_to_trace_for_a_run(tiny_reference, workload):
    """After `warmup`, serving traces no prefill or decode program: the programs it compiled are
    called with the same static arguments (a retrace costs seconds on a real model, even when the
    persistent cache then answers the compile)."""
    _, model = tiny_reference
    engine = JaxEngine(
        model, max_num_seqs=SLOTS, max_model_len=MAX_LEN, decode_steps_per_call=4, smallest_prefill_bucket=64
    )
    engine.warmup(modes=("sample",))
    before = dict(engine_steps.TRACES)
    sampled = [r for r in workload if r.sampling.temperature > 0 and r.sampling.top_p == 1.0]  # the warmed mode
    assert len(engine.generate(sampled)) == len(sampled) >= 6
    assert {k: engine_steps.TRACES[k] - before.get(k, 0) for k in ("prefill", "decode")} == {"prefill": 0, "decode": 0}
