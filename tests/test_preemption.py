"""SIGTERM / SIGINT / SIGHUP through the real CLI: the run writes the last finished step's checkpoint, stops
its engine and exits with 128 + the signal and one line; rerunning the same command continues as if
nothing had happened (metrics and params equal to an uninterrupted run's).

One chain of runs on a copy of one workdir: SIGHUP while the trainer starts (the warm-up stops and
nothing is saved), SIGTERM to the whole process group in the middle of a step, then a resume to
the end, compared with one uninterrupted run. A long warm-up and a held-out eval stop within a step
of their own. The tiny config holds aborted responses' KV through
the train step (`rollout.hold_aborted_kv`, `free_kv_cache_in_train=false`): the signal's checkpoint
keeps those rows, and the resume puts them back, so it equals the uninterrupted run bit for bit
(a re-prefill would not). Then SIGTERM under
`python -m april_jax.cli.launch --nprocs 2`: every process stops at one step and saves it together.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from april_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
ARGS = [
    "--config",
    str(ROOT / "configs/tiny.py"),
    "--config.warmup.steps=2",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=2",
    "--config.rollout.max_num_seqs=8",
    "--config.train.micro_batch_size=4",
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
    f"--config.train.total_steps={STEPS}",
    "--config.checkpoint.every=100",
]  # only the last step saves by itself
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
LINE = re.compile(
    r"stopped by (SIG\w+) after step (\d+) of (\d+): checkpoint at (\S+); rerun the same command to resume"
)


def wall_clock(key: str) -> bool:
    return key.startswith("time/") or key.endswith("_s")


def start(cmd: list[str], log: Path, env=ENV) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True
    )


def wait_for(proc: subprocess.Popen, ready, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"exited with {proc.returncode} too soon:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> tuple[int, str]:
    code = proc.wait(timeout=timeout)
    with pytest.raises(ProcessLookupError):  # nothing of the run's process group is left
        os.killpg(proc.pid, 0)
    return code, log.read_text()


def assert_stopped(code: int, err: str, signum: int, workdir: Path) -> int:
    """Exit 128 + signum, no traceback, the last line names the signal and the checkpoint; the step saved."""
    assert code == 128 + signum, (code, err[-3000:])
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    match = LINE.fullmatch(err.strip().splitlines()[-1])
    assert match, err[-3000:]
    name, done, total, where = match.groups()
    assert name == signal.Signals(signum).name and total == str(STEPS)
    assert Path(where) == workdir / "checkpoints" / done and (Path(where) / "commit_success.txt").exists()
    return int(done)


def restore_params(step_dir: Path) -> dict:
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(step_dir / "params")
    tree = getattr(meta, "item_metadata", meta)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    restored = checkpointer.restore(step_dir / "params", target)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]}


def train(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "april_jax.train", *ARGS, f"--config.workdir={workdir}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(train(workdir), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


@pytest.mark.slow
def test_signals_save_the_last_finished_step_and_the_resume_is_identical(uninterrupted, tmp_path):
    workdir, log = tmp_path / "run", tmp_path / "stderr"

    # SIGHUP (the terminal closed) as soon as the trainer runs: the warm-up stops at once and saves
    # nothing (a rerun warms up again from the same seed)
    proc = start(train(workdir), log)
    wait_for(proc, lambda: "XLA compilation cache:" in log.read_text(), log)
    proc.send_signal(signal.SIGHUP)
    code, err = finish(proc, log)
    assert code == 128 + signal.SIGHUP and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped by SIGHUP before step 1 of {STEPS} finished: nothing to save; rerun the same command to start again"
    )
    assert read_metrics(workdir) == [] and not list((workdir / "checkpoints").glob("*"))

    # SIGTERM to the whole process group (what SLURM does) while step 2 runs: steps 0-1 kept
    proc = start(train(workdir), log)
    wait_for(proc, lambda: len(read_metrics(workdir)) >= 1, log)
    os.killpg(proc.pid, signal.SIGTERM)
    code, err = finish(proc, log)
    done = assert_stopped(code, err, signal.SIGTERM, workdir)
    assert 1 <= done < STEPS and [r["step"] for r in read_metrics(workdir)] == list(range(done)), (
        "at most the step in progress is lost, and nothing written for it"
    )
    meta = json.loads((workdir / "checkpoints" / str(done) / "meta" / "metadata").read_text())
    assert meta["engine_kv"]["slots"], "the engine held aborted responses' KV at the end of the step saved"

    code = subprocess.run(train(workdir), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert code.returncode == 0, code.stderr[-3000:]
    got, want = read_metrics(workdir), read_metrics(uninterrupted)
    assert [r["step"] for r in got] == list(range(STEPS))
    strip = lambda r: {k: v for k, v in r.items() if not wall_clock(k)}
    for a, b in zip(got, want):
        assert strip(a) == strip(b), f"step {a['step']} differs after the stops"
    assert (workdir / "delivered.jsonl").read_text() == (uninterrupted / "delivered.jsonl").read_text()
    a, b = (
        restore_params(workdir / "checkpoints" / str(STEPS)),
        restore_params(uninterrupted / "checkpoints" / str(STEPS)),
    )
    assert a.keys() == b.keys() and len(a) > 5
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_sigterm_in_a_long_warm_up_stops_within_a_step(tmp_path):
    """3,000 warm-up steps take minutes on 2 cores; the stop comes one warm-up step after the signal."""
    workdir, log = tmp_path / "run", tmp_path / "stderr"
    args = [a if not a.startswith("--config.warmup.steps") else "--config.warmup.steps=3000" for a in train(workdir)]
    proc = start(args, log)
    wait_for(proc, lambda: "deployment plan:" in log.read_text(), log)
    time.sleep(3)  # inside the warm-up's steps
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, log)
    assert code == 128 + signal.SIGTERM and "nothing to save" in err.strip().splitlines()[-1], err[-3000:]
    assert time.time() - signalled < 30, "stopped within a warm-up step (and the reward workers' exit)"


def test_an_eval_gives_up_at_the_engines_next_step():
    from april_jax.models import qwen3
    from april_jax.rollout.jax_engine import JaxEngine
    from april_jax.rollout.types import Request, SamplingParams
    from april_jax.runtime.distributed import Abandoned, StopSignal

    cfg = qwen3.Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    engine = JaxEngine(qwen3.init_model(cfg, seed=0), max_num_seqs=4, max_model_len=128)
    stop = StopSignal()
    watched = stop.watching(engine)
    reqs = [Request(f"eval/{i}", [1, 2, 3], 100, SamplingParams(1.0, seed=i)) for i in range(4)]
    engine_step, steps = engine.step, []

    def counting_step():  # the signal arrives while the eval's second engine step runs
        steps.append(1)
        if len(steps) == 2:
            stop.signum = signal.SIGTERM
        return engine_step()

    engine.step = counting_step
    with pytest.raises(Abandoned):
        watched.generate(reqs)
    assert len(steps) == 2 and engine.has_unfinished()  # 100-token requests were far from done
    engine.abort_all()
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_sigterm_under_launch_stops_every_process_at_one_step(tmp_path):
    """2 processes x 2 CPU devices: the launcher passes SIGTERM on; both processes stop after the
    same step (each prints the same line), save it together (one complete orbax checkpoint) and exit
    143, and so does the launcher. (A 2-process checkpoint resuming: tests/test_multiprocess.py.)"""
    workdir, log = tmp_path / "run", tmp_path / "stderr"
    cmd = [
        sys.executable,
        "-m",
        "april_jax.cli.launch",
        "--nprocs",
        "2",
        "--cpu-devices-per-process",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        *train(workdir)[3:],
        "--config.rollout.engine_devices=2",
    ]
    proc = start(cmd, log, dict(ENV, XLA_FLAGS=""))
    wait_for(proc, lambda: len(read_metrics(workdir)) >= 1, log)
    proc.send_signal(signal.SIGTERM)  # to the launcher only: it passes the signal on
    code, err = finish(proc, log)
    done = assert_stopped(code, err, signal.SIGTERM, workdir)
    other = (tmp_path / "logs" / "process_1.log").read_text()
    assert "Traceback" not in other and other.strip().splitlines()[-1] == err.strip().splitlines()[-1], other[-3000:]
    meta = json.loads((workdir / "checkpoints" / str(done) / "meta" / "metadata").read_text())
    assert meta["step"] == done and len(read_metrics(workdir)) == done
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(done)]


def test_the_coordinator_listens_on_loopback_only(tmp_path):
    """Under launch, JAX's coordinator (process 0, the real service) binds 127.0.0.1, not every
    interface (JAX's default, [::]:PORT)."""
    env = dict(ENV, PROBE_DIR=str(tmp_path), PROBE_MODE="listen", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from april_jax.cli.launch import launch; "
            "sys.exit(launch(2, [], cpu_devices=1, module='launch_probe'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sockets = json.loads((tmp_path / "listen_0").read_text())
    assert sockets == ["127.0.0.1"], sockets


def test_a_second_signal_to_the_launcher_kills_at_once(tmp_path):
    """The processes ignore the first SIGTERM (still writing their checkpoint): the launcher waits
    for them (its grace is 300 s), and a second SIGTERM SIGKILLs every one at once; the launcher
    says which process did not stop as asked and exits with its code (137)."""
    env = dict(ENV, PROBE_DIR=str(tmp_path), PROBE_MODE="stubborn", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    code = (
        "import sys; from april_jax.cli.launch import launch; "
        "sys.exit(launch(2, [], cpu_devices=1, module='launch_probe', stop_grace_s=300))"
    )
    log = tmp_path / "stderr"
    proc = start([sys.executable, "-c", code], log, env)
    pid_files = [tmp_path / f"pid_{i}" for i in range(2)]
    wait_for(proc, lambda: all(f.exists() and f.read_text() for f in pid_files), log)
    pids = [int(f.read_text()) for f in pid_files]
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None, "the launcher waits while the processes save"
    for pid in pids:
        os.kill(pid, 0)  # still alive: they ignored the first signal
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, log, timeout=60)
    assert time.monotonic() - t < 30
    assert code == 137 and "launch: stopping on SIGTERM: process 0 exited with 137" in err, (code, err[-2000:])
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
