"""Run N training processes on this machine as one multi-process JAX job.

    python -m april_jax.launch --nprocs 2 --config configs/tiny.py [--config.x=y ...]

Each process runs `python -m april_jax.train` with the arguments given (everything but the
launcher's own flags) and the standard `jax.distributed` environment: JAX_COORDINATOR_ADDRESS
(127.0.0.1 and a free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID. On CPU each process gets
`--cpu-devices-per-process` devices (XLA_FLAGS --xla_force_host_platform_device_count) and
gloo collectives, so `--nprocs 2 --cpu-devices-per-process 4` forms the same 8-device mesh as one
process with 8 devices. Process 0's output streams to this terminal; the others' goes to
LOG_DIR/process_I.log (shown when that process fails). When any process fails, every other one
is stopped and the launcher exits with the failed process's code (128 + signal when killed).
On a cluster, run `python -m april_jax.train` once per host instead (README: SLURM, Kubernetes).
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

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, index: int, nprocs: int, port: int, cpu_devices: int | None) -> dict:
    """The environment of process `index`: jax.distributed's variables, and the CPU device count."""
    env = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nprocs),
               JAX_PROCESS_ID=str(index))
    if cpu_devices is not None:
        flags = re.sub(rf"{DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={cpu_devices}".strip()
    return env


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each process group still running (a trainer's reward workers included), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def launch(nprocs: int, args: list[str], *, cpu_devices: int | None = None, log_dir: Path | None = None,
           module: str = "april_jax.train", port: int | None = None) -> int:
    """Start the processes, wait for them; the job's exit code (0 only if every process exited 0)."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="april_launch_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    procs, logs = [], []
    stopping = []

    def on_signal(signum, _frame):  # Ctrl-C / a scheduler's SIGTERM: stop the whole job
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(nprocs):
            env = process_env(os.environ, i, nprocs, port, cpu_devices)
            out = None if i == 0 else open(log_dir / f"process_{i}.log", "w")
            logs.append(out)
            # own session: stopping a process stops its children (reward workers) too
            procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None, start_new_session=True))
        while True:
            if stopping:
                _stop(procs)
                return 128 + stopping[0]
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                _stop(procs)
                if i:
                    print(f"launch: process {i} exited with {exit_code(code)}; stopped the others. Its last lines "
                          f"({log_dir / f'process_{i}.log'}):\n{_tail(log_dir / f'process_{i}.log')}", file=sys.stderr)
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
    parser = argparse.ArgumentParser(prog="python -m april_jax.launch", description=__doc__.split("\n\n")[0],
                                     epilog="Every other argument goes to python -m april_jax.train.")
    parser.add_argument("--nprocs", type=int, required=True, help="processes to start on this machine")
    parser.add_argument("--cpu-devices-per-process", type=int, default=None,
                        help="CPU devices each process sees (XLA_FLAGS); default: XLA_FLAGS as set")
    parser.add_argument("--log-dir", default=None, help="where processes 1..N-1 log (default: a new temp dir)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ours, rest = parser.parse_known_args(argv)
    if ours.nprocs < 1:
        parser.error(f"--nprocs={ours.nprocs}: must be >= 1")
    if ours.cpu_devices_per_process is not None and ours.cpu_devices_per_process < 1:
        parser.error(f"--cpu-devices-per-process={ours.cpu_devices_per_process}: must be >= 1")
    raise SystemExit(launch(ours.nprocs, rest, cpu_devices=ours.cpu_devices_per_process, log_dir=ours.log_dir,
                            port=ours.port))


if __name__ == "__main__":
    main()
