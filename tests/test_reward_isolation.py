"""Reward code cannot take the run down, and every failure says why.

Through the real CLI (tiny config, 20 warm-up steps, 1-2 RL steps, three runs two at a time from
one module fixture): a reward that raises KeyboardInterrupt, calls sys.exit(7), kills its worker
and leaves processes running scores 0 for those samples while the run trains to its checkpoint,
with each failure kind in WORKDIR/reward_failures.jsonl and nothing of the reward's left running;
a reward that returns None, or a batched one that loses a score, stops the run with the one
error line quoting the first failure. Beside them, the pool itself: each failure's record, a
worker that dies between calls, what a reward started killed by a timeout, by close() and by a
SIGKILLed owner; and FailureLog's file and quote.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_jax.rl.failed_rewards import FailureLog
from april_jax.rl.rewards import TREE_ENV, RewardModel, RewardSample

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
SMALL = [
    "--config.warmup.steps=20",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.rollout.max_num_seqs=16",
    "--config.train.micro_batch_size=8",
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
]


def sample(uid="p3", index=0, pids_file=None) -> RewardSample:
    return RewardSample(
        prompt="q?",
        prompt_text="q?",
        prompt_ids=[1, 2],
        response="the answer is 42",
        response_ids=[3, 4],
        answer="42",
        finish_reason="stop",
        fields={"pids_file": str(pids_file)} if pids_file else {},
        uid=uid,
        index=index,
    )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def token_carriers(prefix: str) -> list[int]:
    """Live processes started with a reward-tree token that begins with `prefix`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or not alive(int(name)):
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(f"{TREE_ENV}={prefix}".encode()) for e in environ):
            found.append(int(name))
    return found


def descendants(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        try:
            parents[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, grew = {root}, True
    while grew:
        kids = {pid for pid, parent in parents.items() if parent in found and pid not in found}
        found |= kids
        grew = bool(kids)
    return sorted(found - {root})


def wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while (left := [p for p in pids if alive(p)]) and time.time() < deadline:
        time.sleep(0.1)
    return left


def read_pids(file: Path) -> list[int]:
    return [int(line) for line in file.read_text().split()] if file.exists() else []


def one_error_line(proc, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, the last one, naming each of `names`."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def train(workdir: Path, fn: str, steps: int, pids: Path):
    """The CLI run, with the trainer's pid (its workers' tokens begin with it)."""
    cmd = [sys.executable, "-m", "april_jax.train", "--config", str(ROOT / "configs/tiny.py")]
    cmd += [f"--config.workdir={workdir}", *SMALL, f"--config.train.total_steps={steps}"]
    cmd += [f"--config.reward.fn=tests.reward_fns:{fn}"]
    env = dict(ENV, APRIL_TEST_CHILD_PIDS=str(pids))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    stdout, stderr = proc.communicate(timeout=600)
    return proc.pid, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reward_isolation")
    pool = cf.ThreadPoolExecutor(max_workers=2)
    jobs = {
        name: pool.submit(train, base / name, name, steps, base / f"{name}.pids")
        for name, steps in [("misbehaves", 2), ("returns_none", 1), ("one_short", 1)]
    }
    yield base, jobs
    pool.shutdown(wait=True)


@pytest.mark.slow
def test_interrupt_exit_and_a_dying_worker_score_zero_and_the_run_trains_on(runs):
    base, jobs = runs
    _, proc = jobs["misbehaves"].result()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    workdir = base / "misbehaves"
    assert (workdir / "checkpoints" / "2").is_dir()
    rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped"] for r in rows] == [0, 0] and rows[-1]["reward/failures"] > 0, rows
    records = [json.loads(l) for l in (workdir / FailureLog.FILE).read_text().splitlines()]
    kinds = {"KeyboardInterrupt": "", "SystemExit": "sys.exit(7)", "WorkerDied": "the reward worker exited with code 3"}
    for step in (0, 1):
        got = {r["error"]: r for r in records if r["step"] == step}
        assert sorted(got) == sorted(kinds), records  # one line per kind and step
        for error, message in kinds.items():
            assert got[error]["fn"] == "tests.reward_fns:misbehaves" and message in got[error]["message"]
            assert re.fullmatch(r"train:\d+#\d", got[error]["sample"]) and got[error]["count"] >= 1
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning: step 0: tests.reward_fns:misbehaves")]
    assert len(warnings) == 3 and "sys.exit(7)" in proc.stderr, proc.stderr[-3000:]  # once per kind per run


@pytest.mark.slow
def test_nothing_a_reward_started_outlives_the_run(runs):
    base, jobs = runs
    trainer_pid, proc = jobs["misbehaves"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = read_pids(base / "misbehaves.pids")
    assert len(pids) >= 6, pids  # two groups or more, three processes for each sample that forked
    assert [p for p in pids if alive(p)] == [], "a reward's child outlived the trainer"
    assert token_carriers(f"{trainer_pid}-") == [], "a process of the reward workers outlived the trainer"


@pytest.mark.slow
def test_a_run_stopped_by_failed_rewards_quotes_the_first_failure(runs):
    base, jobs = runs
    for name, quote in [
        ("returns_none", "TypeError: reward returned None, not a number"),
        ("one_short", "ValueError: batched reward returned 3 scores for 4 samples"),
    ]:
        _, proc = jobs[name].result()
        line = one_error_line(proc, "every reward failed (first failure: ", quote, str(base / name / FailureLog.FILE))
        assert re.search(rf"tests\.reward_fns:{name} on sample train:\d+#\d: ", line), line
        records = [json.loads(l) for l in (base / name / FailureLog.FILE).read_text().splitlines()]
        assert (
            len(records) == 1 and records[0]["step"] == 0 and quote == f"{records[0]['error']}: {records[0]['message']}"
        )
        assert not any((base / name / "checkpoints").iterdir())


def test_every_way_a_reward_fails_scores_zero_with_its_cause(tmp_path):
    """BaseExceptions, a value that is no number, a short batch and a worker's death: 0, counted,
    and recorded with the sample (the models share a forkserver; they start together)."""
    cases = {
        "interrupts": ("KeyboardInterrupt", ""),
        "exits_7": ("SystemExit", "sys.exit(7)"),
        "returns_none": ("TypeError", "reward returned None, not a number"),
        "not_a_number": ("ValueError", "reward returned nan, not a finite number"),
        "one_short": ("ValueError", "batched reward returned 1 score for 2 samples"),
        "explodes": ("RuntimeError", "judge crashed"),
        "dies": ("WorkerDied", "the reward worker exited with code 3 while scoring"),
    }
    models = {name: RewardModel(f"tests.reward_fns:{name}", workers=1) for name in cases}
    try:
        for name, (error, message) in cases.items():
            model = models[name]
            assert model.score_many([sample(index=0), sample(index=1)]) == [0.0, 0.0], name
            assert model.failures == 2 and model.timeouts == 0, name
            record = dict(sample="p3#0", fn=f"tests.reward_fns:{name}", error=error, message=message, count=2)
            assert model.failure_log.step == {error: record}, name
    finally:
        for model in models.values():
            model.close()


def test_a_worker_that_dies_between_calls_is_replaced():
    """A worker exits after its call returned: pebble's pool is broken then (no call was running
    to fail); the next submission starts a new pool."""
    model = RewardModel("tests.reward_fns:dies_after_returning", workers=1)
    try:
        assert model.score(sample()) == 1.0
        deadline = time.time() + 20
        while model._pool.active and time.time() < deadline:
            time.sleep(0.1)
        assert model.score(sample()) == 1.0 and model.failures == 0
    finally:
        model.close()


def test_what_a_reward_started_dies_with_its_worker_and_with_close(tmp_path):
    """A call that forks then hangs: its timeout kills the worker and what the call started (the
    pool goes on); close() kills what the finished calls left running, wherever it went."""
    pids = tmp_path / "pids"
    hangs = RewardModel("tests.reward_fns:forks_and_hangs", workers=1, timeout_s=2.0)
    forks = RewardModel("tests.reward_fns:forks", workers=2)
    try:
        assert hangs.score(sample(pids_file=pids)) == 0.0 and hangs.timeouts == 1
        started = read_pids(pids)
        assert len(started) == 3 and wait_gone(started, 10) == [], "a timed-out call's children outlived it"
        assert forks.score_many([sample(index=i, pids_file=pids) for i in range(3)]) == [1.0] * 3
        left_running = read_pids(pids)[3:]
        assert len(left_running) == 9 and all(alive(p) for p in left_running)
        token = forks._token
        forks.close()
        assert [p for p in left_running if alive(p)] == [] and token_carriers(token) == []
    finally:
        hangs.close()
        forks.close()


def test_a_sigkilled_owner_takes_what_rewards_started_along(tmp_path):
    """SIGKILL the process that owns the pool after its rewards left processes running (a forked
    copy of the worker holds the forkserver's pipe open, so the forkserver outlives its owner):
    the workers notice and kill every process of the pool's trees."""
    script, pids_file = tmp_path / "owner.py", tmp_path / "pids"
    script.write_text(
        "import time\n"
        "from april_jax.rl.rewards import RewardModel\n"
        "from tests.test_reward_isolation import sample\n"
        "if __name__ == '__main__':\n"
        "    m = RewardModel('tests.reward_fns:forks', workers=2, timeout_s=600)\n"
        f"    m.score_many([sample(index=0, pids_file={str(pids_file)!r}), sample(index=1, pids_file={str(pids_file)!r})])\n"
        "    print('scored', flush=True)\n"
        "    time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "scored"
        started = read_pids(pids_file)
        assert len(started) == 6 and all(alive(p) for p in started)
        workers = descendants(owner.pid)  # its forkserver, the workers and what they started
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert wait_gone(started, 20) == [], "a reward's child outlived its killed owner"
        assert wait_gone(workers, 10) == [] and token_carriers(f"{owner.pid}-") == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_failure_log_file_warnings_and_quote(tmp_path, capsys):
    """One line per kind and step; a warning the first time a kind appears; the quote is the first
    failure since the last step that trained; a resumed run drops the lines of the steps it redoes."""
    path = tmp_path / FailureLog.FILE
    path.write_text("".join(json.dumps({"step": s, "error": "Old"}) + "\n" for s in range(4)))
    log = FailureLog()
    assert log.cause() == "an exception, NaN or a timeout"
    log.add("m:f", "u1#0", "TypeError", "reward returned None,\n  not a number")
    log.add("m:f", "u1#1", "TypeError", "other")
    log.add("m:f", "u2#0", "TimeoutError", "no reward within reward.timeout_s=5 s")
    log.write(tmp_path, 2, trained=True)  # resumed at step 2
    log.add("m:f", "u3#2", "KeyError", "'x' " * 200)
    log.write(tmp_path, 3, trained=False)
    log.add("m:f", "u4#0", "TypeError", "again")
    log.write(tmp_path, 4, trained=False)
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    assert [(r["step"], r["error"]) for r in rows] == [
        (0, "Old"),
        (1, "Old"),
        (2, "TypeError"),
        (2, "TimeoutError"),
        (3, "KeyError"),
        (4, "TypeError"),
    ]
    assert rows[2] == dict(
        step=2, sample="u1#0", fn="m:f", error="TypeError", message="reward returned None, not a number", count=2
    )
    assert len(rows[4]["message"]) == 300 and rows[4]["message"].endswith("...")
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(": ")[3] for w in warnings] == ["TypeError", "TimeoutError", "KeyError"]
    assert "counted in reward/timeouts" in warnings[1] and str(path) in warnings[0]
    assert log.cause().startswith("first failure: m:f on sample u3#2: KeyError: 'x' 'x'")
    assert log.cause().endswith(f"; each step's failures: {path}")
