"""The JAX engine's cost follows its work: decode over the busy slots only (batch and cache length
buckets), and a group's resumed members prefill their shared prompt once. Each against the
full-batch path, separate prefills, and transformers greedy."""

import numpy as np
import pytest

from april_jax.rollout import engine_steps
from april_jax.rollout.jax_engine import JaxEngine, merge_buckets
from april_jax.rollout.types import Request, SamplingParams
from engine_utils import GREEDY, tiny_reference_and_model, transformers_greedy

SLOTS, MAX_LEN = 16, 160


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_reference_and_model(tmp_path_factory.mktemp("compact"))


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
def compact_and_full(tiny, workload):
    _, model = tiny
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


def test_compacted_greedy_decode_matches_transformers(tiny, compact_and_full, workload):
    ref, _ = tiny
    (compact, _), _, _ = compact_and_full
    for r in workload[::2][:6]:
        assert compact[r.request_id].token_ids == transformers_greedy(ref, r.prompt_ids, r.max_new_tokens), r.request_id


def test_bucketed_batches_compile_once_per_bucket(tiny, compact_and_full, workload):
    """Busy counts 16 -> 1 and contexts 2 -> 130 over the run: decode compiled at most once per
    (batch bucket {4, 8, 16}, length bucket {64, 128, 160}, mode), and a second run compiles nothing."""
    _, model = tiny
    _, _, traces = compact_and_full
    assert 0 < traces <= 3 * 3 * 3
    before = engine_steps.TRACES["decode"]
    again, _ = run(model, list(reversed(workload)))  # other busy counts at each step, same buckets
    assert engine_steps.TRACES["decode"] == before
    assert again[workload[0].request_id].token_ids == compact_and_full[0][0][workload[0].request_id].token_ids


@pytest.fixture(scope="module")
def resumed_groups(tiny):
    """Two groups of 4; each member cut after 0..9 tokens of its own seeded continuation, as APRIL
    aborts and resumes them (prompt + partial, a fresh request with the group's prompt as prefix)."""
    _, model = tiny
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
        out.append(Request(rid, prompt + r.token_ids[:n], 24 - n, SamplingParams(1.0, seed=seed_offset + hash(rid) % 997),
                           shared_prefix_len=len(prompt) if shared else 0))
    return out


def test_resumed_members_share_one_prompt_prefill(tiny, resumed_groups):
    _, model = tiny
    prompts, full, cut = resumed_groups
    shared, shared_stats = run(model, resume(prompts, full, cut, shared=True), samples_per_prompt=4)
    separate, separate_stats = run(model, resume(prompts, full, cut, shared=False), samples_per_prompt=4)
    for rid in full:
        assert shared[rid].token_ids == separate[rid].token_ids, rid
        np.testing.assert_allclose(shared[rid].logprobs, separate[rid].logprobs, atol=1e-5)
    partial_tokens = sum(cut.values())
    assert shared_stats.prefill_tokens == sum(map(len, prompts)) + partial_tokens
    assert separate_stats.prefill_tokens == 4 * sum(map(len, prompts)) + partial_tokens


def test_greedy_resume_from_a_shared_prefix_continues_the_uninterrupted_run(tiny, resumed_groups):
    ref, model = tiny
    prompts, _, cut = resumed_groups
    uninterrupted = {g: run(model, [Request("x", p, 24, GREEDY)])[0]["x"] for g, p in enumerate(prompts)}
    requests = [Request(f"{g}/{j}", p + uninterrupted[g].token_ids[: cut[f"{g}/{j}"]], 24 - cut[f"{g}/{j}"], GREEDY,
                        shared_prefix_len=len(p)) for g, p in enumerate(prompts) for j in range(4)]
    out, _ = run(model, requests, samples_per_prompt=4)
    for g, p in enumerate(prompts):
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


def test_merged_length_buckets_give_the_same_tokens_in_fewer_calls(tiny, resumed_groups, workload):
    """Prompts of 21 and 40 tokens (prefill buckets 32 and 64) and partials of 0-9 tokens (extend
    buckets 8 and 16): one call per bucket, or one for all."""
    _, model = tiny
    prompts, full, cut = resumed_groups
    for requests in (resume(prompts, full, cut, shared=True), workload):
        apart, apart_stats = run(model, requests, samples_per_prompt=4)
        merged, merged_stats = run(model, requests, samples_per_prompt=4, merge_padding_tokens=10_000)
        for r in requests:
            assert merged[r.request_id].token_ids == apart[r.request_id].token_ids, r.request_id
            np.testing.assert_allclose(merged[r.request_id].logprobs, apart[r.request_id].logprobs, atol=1e-5)
        assert merged_stats.model_calls < apart_stats.model_calls
