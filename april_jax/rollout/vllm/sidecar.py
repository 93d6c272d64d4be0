"""Run a server command so that it cannot outlive its trainer.

    python -m april_jax.rollout.vllm.sidecar --parent TRAINER_PID [--pidfile FILE] -- CMD ...

The trainer starts this in a new session, so this process leads a process group that also holds
the server and everything the server spawns (vLLM on CPU: the API server, `VLLM::EngineCore`,
`VLLM::Worker`, a resource tracker). vLLM does not tie its children to their parent: a SIGKILLed
API server leaves the engine core and worker running, and a SIGKILLed trainer leaves all of them.
Here:
- the kernel signals this process when the trainer dies (PR_SET_PDEATHSIG), and a 0.2 s poll of
  `getppid()` catches the same (a reparented process has a new parent; no pid reuse issue, and it
  also covers a PDEATHSIG sent because the trainer *thread* that spawned us ended);
- when the trainer is gone, the server exits, or we get SIGTERM/SIGINT/SIGHUP: SIGTERM to the
  server (vLLM's own shutdown stops its children and frees its /dev/shm segments), up to
  `--grace` seconds, then SIGKILL to the whole group, this process included.
- the server runs with umask 077, so the IPC sockets and shared memory vLLM makes for its own
  processes are the owner's only;
- the pidfile (written by the trainer) is removed when it still names us, so a restarted trainer
  finds either nothing or a live group it may kill (`server.kill_stale`).

Standard library only: it runs in the vLLM interpreter.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.2


def set_parent_death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the getppid poll still catches a dead trainer
        return False


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="pid of the trainer this server serves")
    parser.add_argument("--pidfile", default=None)
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no server command after --")
    if os.getpid() != os.getpgrp():
        os.setsid()  # lead our own group even when started by hand
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: stop.append(f"signal {signal.Signals(s).name}"))
    signal.signal(signal.SIGUSR1, lambda s, _f: None)  # parent death: the poll below decides
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != args.parent:  # the trainer died before the signal was armed
        _drop_pidfile(args.pidfile)
        _say(f"trainer {args.parent} is already gone; not starting")
        return 1
    os.umask(0o077)  # what the server creates (its ZMQ sockets in /tmp, /dev/shm segments) is the owner's
    server = subprocess.Popen(cmd)  # same process group as us
    while not stop:
        if os.getppid() != args.parent:
            stop.append(f"trainer {args.parent} is gone")
        elif (rc := server.poll()) is not None:
            stop.append(f"server exited with {rc}")
        else:
            time.sleep(POLL_S)
    _say(f"{stop[0]}: stopping the server's process group")
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(args.grace)
        except subprocess.TimeoutExpired:
            pass
    _drop_pidfile(args.pidfile)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.killpg(os.getpgrp(), signal.SIGKILL)  # what is left (engine core, worker), and us
    return 0


if __name__ == "__main__":
    sys.exit(main())
