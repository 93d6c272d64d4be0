"""Run N training processes on this machine as one multi-process JAX job.

    python -m april_jax.cli.launch --nprocs 2 --config configs/tiny.py [--config.x=y ...]

Each process runs `python -m april_jax.train` with the arguments given (everything but the
launcher's own flags) and the standard `jax.distributed` environment: JAX_COORDINATOR_ADDRESS
(127.0.0.1 and a free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID, and JAX_COORDINATOR_BIND_ADDRESS
(the same loopback address: JAX's coordinator would otherwise listen on every interface). On
CPU each process gets `--cpu-devices-per-process` devices (XLA_FLAGS
--xla_force_host_platform_device_count) and gloo collectives, so `--nprocs 2
--cpu-devices-per-process 4` forms the same 8-device mesh as one process with 8 devices. Process 0's output streams to this terminal; the others' goes to
LOG_DIR/process_I.log (shown when that process fails). When any process fails, every other one
is stopped and the launcher exits with the failed process's code (128 + signal when killed).

SIGTERM / SIGINT / SIGHUP (a scheduler's preemption, Ctrl-C, a closed terminal) is passed on to every process (and its
reward workers): the trainers agree on a step, write its checkpoint and exit with 128 + the
signal; the launcher waits for them (up to --stop-grace-s, then SIGKILL) and exits with the same
code. A second signal SIGKILLs them at once (the last complete checkpoint stays intact).

On a cluster, run `python -m april_jax.train` once per host instead (README: SLURM, Kubernetes),
and see april_jax/runtime/distributed.py for where the coordinator listens there.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from april_jax.cli import prog

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_unusable(port: int) -> str | None:
    """Why the coordinator could not listen on 127.0.0.1:`port`, or None. Checked before any process
    starts: JAX's coordinator crashes process 0 (gRPC 'Failed to add port', SIGSEGV) on a taken port."""
    if not 0 < port < 65536:
        return "not a TCP port (1-65535)"
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return "already in use" if e.errno == 98 else (e.strerror or str(e))
    return None


def process_env(base: dict, index: int, nprocs: int, port: int, cpu_devices: int | None) -> dict:
    """The environment of process `index`: jax.distributed's variables, and the CPU device count."""
    env = dict(
        base,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(nprocs),
        JAX_PROCESS_ID=str(index),
        JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
    )
    if cpu_devices is not None:
        flags = re.sub(rf"{DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={cpu_devices}".strip()
    return env


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_groups(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _stop(
    procs: list[subprocess.Popen], grace_s: float = 10.0, signum: int = signal.SIGTERM, give_up=lambda: False
) -> None:
    """Send `signum` to each process group still running (a trainer's reward workers included),
    then SIGKILL what is left after `grace_s`, or as soon as `give_up()` says so."""
    _signal_groups(procs, signum)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not give_up():
        time.sleep(0.1)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _stopped_code(procs: list[subprocess.Popen], signum: int, log_dir: Path) -> int:
    """128 + signum when every process stopped as asked (each saved and exited with that code);
    otherwise the first other code, with the line that says which process."""
    wanted = 128 + signum
    for i, p in enumerate(procs):
        code = exit_code(p.returncode)
        if code != wanted:
            where = f" ({log_dir / f'process_{i}.log'})" if i else ""
            print(
                f"launch: stopping on {signal.Signals(signum).name}: process {i} exited with {code}{where}",
                file=sys.stderr,
            )
            return code
    return wanted


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


STOP_GRACE_S = 300.0  # a trainer stopping on SIGTERM writes a checkpoint: an 8B model's takes minutes


def launch(
    nprocs: int,
    args: list[str],
    *,
    cpu_devices: int | None = None,
    log_dir: Path | None = None,
    module: str = "april_jax.train",
    port: int | None = None,
    stop_grace_s: float = STOP_GRACE_S,
) -> int:
    """Start the processes, wait for them; the job's exit code (0 only if every process exited 0)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="april_launch_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    procs, logs = [], []
    stopping = []

    def on_signal(signum, _frame):  # Ctrl-C / a scheduler's SIGTERM: stop the whole job
        stopping.append(signum)  # the first: passed on; a second: SIGKILL now

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for i in range(nprocs):
            env = process_env(os.environ, i, nprocs, port, cpu_devices)
            out = None if i == 0 else open(log_dir / f"process_{i}.log", "w")
            logs.append(out)
            # own session: stopping a process stops its children (reward workers) too
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    start_new_session=True,
                )
            )
        while True:
            if stopping:
                signum = stopping[0]
                _stop(procs, stop_grace_s, signum, give_up=lambda: len(stopping) > 1)
                return _stopped_code(procs, signum, log_dir)
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                _stop(procs)
                if i:
                    print(
                        f"launch: process {i} exited with {exit_code(code)}; stopped the others. Its last lines "
                        f"({log_dir / f'process_{i}.log'}):\n{_tail(log_dir / f'process_{i}.log')}",
                        file=sys.stderr,
                    )
                else:
                    print(f"launch: process 0 exited with {exit_code(code)}; stopped the others", file=sys.stderr)
                return exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        _stop(procs)
        for f in logs:
            if f is not None:
                f.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog("april_jax.cli.launch"),
        description=__doc__.split("\n\n")[0],
        epilog="Every other argument goes to python -m april_jax.train.",
    )
    parser.add_argument("--nprocs", type=int, required=True, help="processes to start on this machine")
    parser.add_argument(
        "--cpu-devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process sees (XLA_FLAGS); default: XLA_FLAGS as set",
    )
    parser.add_argument("--log-dir", default=None, help="where processes 1..N-1 log (default: a new temp dir)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=STOP_GRACE_S,
        help="on SIGTERM/SIGINT, how long the processes may take to checkpoint and exit before "
        "SIGKILL (default %(default)s)",
    )
    ours, rest = parser.parse_known_args(argv)
    if ours.nprocs < 1:
        parser.error(f"--nprocs={ours.nprocs}: must be >= 1")
    if ours.stop_grace_s < 0:
        parser.error(f"--stop-grace-s={ours.stop_grace_s}: must be >= 0")
    if ours.cpu_devices_per_process is not None and ours.cpu_devices_per_process < 1:
        parser.error(f"--cpu-devices-per-process={ours.cpu_devices_per_process}: must be >= 1")
    if ours.port is not None and (why := port_unusable(ours.port)):
        print(f"error: --port {ours.port}: {why} (leave --port out for a free one)", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(
        launch(
            ours.nprocs,
            rest,
            cpu_devices=ours.cpu_devices_per_process,
            log_dir=ours.log_dir,
            port=ours.port,
            stop_grace_s=ours.stop_grace_s,
        )
    )


if __name__ == "__main__":
    main()
