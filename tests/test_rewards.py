"""Reward API: every call form in real worker processes, timeouts that kill and replace a stuck
worker, failures counted, math-verify's own answer extraction, and APRIL scoring off the engine loop."""

import os
import time

import pytest

from april_jax.config import ConfigError
from april_jax.data.types import PromptRecord
from april_jax.rl.rewards import GroupScorer, RewardModel, RewardSample, call_form, load_function
from april_jax.rollout.april import April
from april_jax.rollout.config import RolloutConfig
from april_jax.rollout.sim_engine import SimEngine


def sample(response="the answer is 42", answer="42", **kw):
    base = dict(
        prompt=[{"role": "user", "content": "q?"}],
        prompt_text="<user>q?",
        prompt_ids=[1, 2],
        response=response,
        response_ids=list(range(len(response.split()))),
        answer=answer,
        finish_reason="stop",
        fields={"difficulty": "easy"},
    )
    return RewardSample(**{**base, **kw})


def test_call_form_is_read_from_the_signature():
    assert call_form(load_function("tests.reward_fns:text_answer")) == "text_answer"
    assert call_form(load_function("tests.reward_fns:uses_sample")) == "sample"
    assert call_form(load_function("tests.reward_fns:by_group")) == "batched"
    assert call_form(load_function("tests.reward_fns:awaits")) == "async"
    assert call_form(load_function("math_verify")) == "sample"
    with pytest.raises(ConfigError, match="config key 'reward.fn'='no_such_module:f': no module 'no_such_module'"):
        RewardModel("no_such_module:f")
    with pytest.raises(ConfigError, match="config key 'reward.fn'='nocolon': expected"):
        RewardModel("nocolon")


def test_every_call_form_scores_in_worker_processes():
    samples = [sample("a b c", "b"), sample("x", "b"), sample("p q", "z")]
    for spec, expected in [
        ("tests.reward_fns:text_answer", [1.0, 0.0, 0.0]),
        ("tests.reward_fns:uses_sample", [1.0, 1.0, 1.0]),
        ("tests.reward_fns:by_group", [2.0, 0.0, 1.0]),
        ("tests.reward_fns:awaits", [3.0, 1.0, 2.0]),
    ]:
        model = RewardModel(spec, workers=2)
        try:
            assert model.score_many(samples) == expected, spec
            assert model.failures == 0 and model.timeouts == 0
        finally:
            model.close()


def test_failures_and_non_finite_rewards_score_zero_and_are_counted():
    model = RewardModel("tests.reward_fns:explodes", workers=1)
    nan = RewardModel("tests.reward_fns:not_a_number", workers=1)
    try:
        assert model.score_many([sample(), sample()]) == [0.0, 0.0] and model.failures == 2
        assert nan.score(sample()) == 0.0 and nan.failures == 1
    finally:
        model.close()
        nan.close()


def test_stuck_reward_is_killed_replaced_and_counted():
    model = RewardModel("tests.reward_fns:hangs_on_seven", workers=2, timeout_s=1.0)
    try:
        t = time.perf_counter()
        scores = model.score_many([sample(answer="7"), sample(answer="1"), sample(answer="17"), sample(answer="2")])
        assert scores == [0.0, 1.0, 0.0, 1.0] and model.timeouts == 2 and model.failures == 0
        assert time.perf_counter() - t < 20
        # both workers were stuck and killed: new ones answer
        assert model.score_many([sample(answer="3")] * 4) == [1.0] * 4 and model.timeouts == 2
        model.submit([sample(answer="7")])  # left stuck in a worker: close must still return
    finally:
        t = time.perf_counter()
        model.close()
        assert time.perf_counter() - t < 10


def test_math_verify_extracts_the_answer_itself():
    model = RewardModel("math_verify", workers=2)
    cases = [
        ("so the total is \\boxed{18}.", "18", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("She pays 5 + 13 = 18 dollars.", "18", 1.0),
        ("\\boxed{19}", "18", 0.0),
        # two different boxed answers parse as a set: hedging is not rewarded
        ("maybe \\boxed{3}, or rather \\boxed{18}", "18", 0.0),
    ]
    try:
        assert model.score_many([sample(r, a) for r, a, _ in cases]) == [e for _, _, e in cases]
    finally:
        model.close()


class OneTokenPerStepEngine(SimEngine):
    """The simulated engine slowed to real time, so that scoring and generation can overlap."""

    def step(self):
        time.sleep(0.02)
        return super().step()


def test_april_scores_finished_groups_beside_the_engine():
    """Slow rewards (0.5 s each) in 4 workers while the engine keeps generating: the groups arrive
    scored, the row's fields reach the reward function, and the rollout spends less time blocked on
    rewards than scoring them one after another would take."""
    model = RewardModel("tests.reward_fns:slow", workers=4, timeout_s=10)
    uses = RewardModel("tests.reward_fns:uses_sample", workers=2)
    prompts = (
        PromptRecord(f"p{i}", [5, 6, 7], answer="1", prompt=f"question {i}", fields={"difficulty": "easy"})
        for i in range(1000)
    )
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4, max_response_len=64)
    try:
        decode = lambda ids: " ".join(map(str, ids))
        april = April(cfg, prompts, GroupScorer(model, decode))
        groups, metrics = april.collect(OneTokenPerStepEngine(slots=16, seed=0, length_scale=1 / 512), 0)
        assert len(groups) == 2 and all(s.reward == 1.0 for g in groups for s in g.samples)
        serial_s = 0.5 * 4 * len(groups)
        assert metrics["reward/wait_s"] < serial_s, metrics["reward/wait_s"]
        april = April(cfg, prompts, GroupScorer(uses, decode))
        groups, _ = april.collect(SimEngine(slots=16, seed=0, length_scale=1 / 512), 0)
        assert [s.reward for g in groups for s in g.samples] == [1.0] * 8
    finally:
        model.close()
        uses.close()


def test_stuck_worker_dies_with_a_killed_trainer(tmp_path):
    """SIGKILL the process that owns the pool while a worker is stuck in a call: the worker goes too
    (pebble workers exit when the pool owner is gone), no orphan left holding a CPU."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(
        "import os, sys, time\n"
        "from april_jax.rl.rewards import RewardModel\n"
        "from tests.test_rewards import sample\n"
        "if __name__ == '__main__':\n"
        "    m = RewardModel('tests.reward_fns:hangs_on_seven', workers=1, timeout_s=600)\n"
        "    m.submit([sample(answer='7')])\n"
        "    time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    owner = subprocess.Popen([sys.executable, str(script)], cwd=root, env=dict(os.environ, PYTHONPATH=root))
    try:
        deadline = time.time() + 120
        workers = []
        while time.time() < deadline and not workers:  # the worker is the owner's grandchild
            time.sleep(0.5)
            workers = [p for p in _pids() if _ancestor(p, owner.pid) and _parent(p) != owner.pid]
        assert workers, "no worker started"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "a stuck reward worker outlived its trainer"
    finally:
        if owner.poll() is None:
            owner.kill()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _ancestor(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
