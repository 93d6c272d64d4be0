"""The vLLM server dies with its trainer and a restarted trainer never meets a stale one.

The watchdog (`april_jax.rollout.vllm.sidecar`) is first checked with a stand-in server (a shell
that spawns children, as vLLM spawns its engine core and worker: cheap, no vLLM); then for real:
the trainer CLI runs SmolLM2-135M (Llama) on vLLM from the packaged checkpoint, is SIGKILLed
mid-run, and every process of its server must be gone within seconds.
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

from april_jax.rollout.vllm.server import SIDECAR, group_pids, healthy, kill_stale

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("APRIL_JAX_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
# a stand-in server with two children of its own
FAKE_SERVER = ["sh", "-c", "sleep 300 & sleep 300 & wait"]
# a "trainer": launches the sidecar as VllmServer does, prints its pid, then waits to be killed
TRAINER = """
import os, subprocess, sys, time
cmd = [sys.executable, "-m", "{sidecar}", "--parent", str(os.getpid()), *sys.argv[1:]]
p = subprocess.Popen(cmd, start_new_session=True)
print(p.pid, flush=True)
time.sleep(600)
"""


def wait_until(predicate, timeout: float, step: float = 0.1) -> float:
    """Seconds until `predicate()` held; fails the test after `timeout`."""
    t0 = time.time()
    while not predicate():
        if time.time() - t0 > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.time() - t0


def launch(args, *, via_trainer=False):
    """(trainer or None, sidecar pid = its group, sidecar Popen or None): a sidecar started by a
    throwaway trainer process, or by this test process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not via_trainer:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", SIDECAR, "--parent", str(os.getpid()), *args], start_new_session=True, env=env
        )
        return None, sidecar.pid, sidecar
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER.format(sidecar=SIDECAR), *args], stdout=subprocess.PIPE, text=True, env=env
    )
    return trainer, int(trainer.stdout.readline()), None


def test_sidecar_group_dies_with_a_sigkilled_trainer():
    trainer, pgid, _ = launch(["--", *FAKE_SERVER], via_trainer=True)
    wait_until(lambda: len(group_pids(pgid)) == 4, 30)  # sidecar, sh, two sleeps
    trainer.kill()
    trainer.wait()
    assert wait_until(lambda: not group_pids(pgid), 10) < 10


def test_sidecar_reaps_the_children_of_a_server_that_died():
    _, pgid, sidecar = launch(["--", "sh", "-c", "sleep 300 & sleep 0.5; exit 3"])
    wait_until(lambda: sidecar.poll() is not None, 30)
    assert not group_pids(pgid)  # the orphaned sleep went with it


def test_restart_kills_the_stale_group_named_by_the_pidfile(tmp_path):
    pidfile = tmp_path / "vllm_server0.pid"
    _, pgid, sidecar = launch(["--pidfile", str(pidfile), "--", *FAKE_SERVER])
    pidfile.write_text(f"{pgid}\nhttp://127.0.0.1:1\n")
    wait_until(lambda: len(group_pids(pgid)) == 4, 30)
    assert kill_stale(pidfile) and not group_pids(pgid) and not pidfile.exists()
    sidecar.wait()
    # a pidfile naming a process that is not our sidecar for this pidfile is left alone
    bystander = subprocess.Popen(["sleep", "300"])
    pidfile.write_text(f"{bystander.pid}\n")
    assert not kill_stale(pidfile) and bystander.poll() is None and not pidfile.exists()
    bystander.kill()
    bystander.wait()


# ---- the real thing: the trainer CLI on SmolLM2 (Llama) with a vLLM server it launched ----


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
    """A SmolLM2 GSM8K run on vLLM, from the packaged checkpoint only (no hand-copied files),
    observed until the server it launched answers; the trainer is still running afterwards (its
    first train step alone takes minutes on CPU, so the tests do not wait for it)."""
    assert Path(VLLM_PYTHON).exists(), f"{VLLM_PYTHON}: no vLLM interpreter (run scripts/install.sh)"
    workdir = tmp_path_factory.mktemp("smollm2_vllm") / "w"
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/smollm2_gsm8k.py"),
        f"--config.workdir={workdir}",
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={VLLM_PYTHON}",
        "--config.train.total_steps=2",
        "--config.rollout.rollout_batch_size=2",
        "--config.rollout.over_sampling_batch_size=2",
        "--config.rollout.n_samples_per_prompt=2",
        "--config.rollout.max_response_len=16",
        "--config.rollout.max_num_seqs=4",
        "--config.train.micro_batch_size=4",
        "--config.reward.workers=1",
        "--config.checkpoint.every=100",
        # no step-0 evaluation: its 100 GSM8K prompts would queue ahead of the test's request
        # (FCFS on 4 slots; on a loaded 2-core CI machine that took over 120 s)
        "--config.eval.every=0",
        "--config.log.tensorboard=false",
        "--config.log.progress=false",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    log = open(workdir.parent / "trainer.log", "w")
    trainer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    pidfile = workdir / "vllm_server0.pid"
    try:
        deadline = time.time() + 600
        while not (
            pidfile.exists() and len(pidfile.read_text().split()) >= 2 and healthy(pidfile.read_text().split()[1])
        ):
            if trainer.poll() is not None or time.time() > deadline:
                pytest.fail(
                    f"trainer exited ({trainer.returncode}) or timed out before its server answered:\n"
                    f"{(workdir.parent / 'trainer.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield trainer, workdir, pidfile
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()
        log.close()
        if pidfile.exists():  # the test failed: do not leave the server behind
            kill_stale(pidfile)


@pytest.mark.slow
def test_vllm_serves_the_llama_checkpoint_launched_by_the_trainer(smollm2_run):
    trainer, workdir, pidfile = smollm2_run
    from april_jax import assets

    source = Path(assets.smollm2_135m_instruct())
    init = workdir / "vllm_init"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (init / name).read_bytes() == (source / name).read_bytes(), name
    assert json.loads((init / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # The server answers from the checkpoint the trainer wrote, with the run's tokenizer (the
    # prompt goes in as text): greedy on a chat prompt says Paris. The key is read from the
    # sidecar's environment, which only its owner may read.
    pid, url = pidfile.read_text().split()[:2]
    environ = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv
    )
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(source)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    body = {"model": "policy", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {environ['VLLM_API_KEY']}"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    assert "Paris" in text, text


@pytest.mark.slow
def test_sigkilled_trainer_takes_its_vllm_server_along(smollm2_run):
    from april_jax.rollout.vllm import proctree

    trainer, workdir, pidfile = smollm2_run
    pgid, _url, token = pidfile.read_text().split()[:3]
    members = {pid: proctree.start_time(pid) for pid in proctree.tree_pids(token)}
    assert len(members) >= 5, members  # sidecar, API server, engine core, worker, resource tracker
    # the weight transport: a full copy of the weights in shared memory, named after the trainer
    transport = list(Path("/dev/shm").glob(f"april_jax_weights_*_{trainer.pid}-*"))
    assert len(transport) == 1, transport
    assert trainer.poll() is None, "the run ended before it could be killed"
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    took = wait_until(lambda: all(proctree.start_time(p) != t for p, t in members.items()), 15)
    print(f"server tree of {len(members)} processes gone {took:.1f}s after the trainer's SIGKILL")
    assert not group_pids(int(pgid)) and not proctree.tree_pids(token) and not pidfile.exists()
    wait_until(lambda: not transport[0].exists(), 5)


# ---- finding the vLLM interpreter: one line saying what to set, never a traceback ----


def _train_with_vllm_python(tmp_path, vllm_python):
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={tmp_path / 'w'}",
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={vllm_python}",
        "--config.warmup.steps=0",
        "--config.log.tensorboard=false",
        "--config.log.progress=false",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "Traceback" not in stderr, stderr[-2000:]
    lines = [l for l in stderr.splitlines() if "rollout.vllm_python" in l]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(vllm_python) in lines[0], stderr[-2000:]
    # nothing of the run is left in shared memory (its transport folder is named after its pid)
    assert not list(Path("/dev/shm").glob(f"april_jax_weights_*_{proc.pid}-*")) if Path("/dev/shm").is_dir() else True
    return lines[0]


@pytest.mark.parametrize("case", ["missing", "folder", "script that exits 0"])
def test_an_unusable_vllm_interpreter_is_one_line_naming_the_key_and_the_path(tmp_path, case):
    if case == "missing":
        path, expected = tmp_path / "no-venv/bin/python", "no such file"
    elif case == "folder":
        path, expected = tmp_path / "venv", "is a folder"
        path.mkdir()
    else:  # it would pass a probe that only looks at the exit code, then "serve" nothing
        path, expected = tmp_path / "python", "is not a Python interpreter"
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    assert expected in _train_with_vllm_python(tmp_path, path)


@pytest.mark.slow
def test_a_real_server_that_fails_to_start_is_one_line_with_vllm_s_reason_and_its_log(tmp_path):
    """A real vLLM that refuses the model (a context longer than the model's positions) exits
    before it is healthy: the trainer says vLLM's own reason and the log file, no traceback."""
    from vllm_servers import vllm_python

    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={tmp_path / 'w'}",
        "--config.rollout.engine=vllm",
        f"--config.rollout.vllm_python={vllm_python()}",
        "--config.rollout.max_model_len=8192",
        "--config.train.micro_batch_size=1",  # the deployment plan must fit 8192-token rows on this host
        "--config.warmup.steps=0",
        "--config.log.tensorboard=false",
        "--config.log.progress=false",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
    errors = [l for l in stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, stderr[-2000:]
    assert "exited with 1 before it was ready" in errors[0] and "max_model_len (8192)" in errors[0], errors[0]
    log = re.search(r"whole log: (\S+)\)$", errors[0])
    assert log and Path(log.group(1)).is_file() and "max_model_len" in Path(log.group(1)).read_text()
    assert not list(Path("/dev/shm").glob(f"april_jax_weights_*_{proc.pid}-*"))


def test_a_non_executable_or_foreign_binary_is_not_taken_for_an_interpreter(tmp_path):
    from april_jax.rollout.vllm.server import VllmSetupError, find_vllm_python

    text = tmp_path / "python"
    text.write_text("not a program")
    with pytest.raises(VllmSetupError, match=r"^rollout\.vllm_python=.*: not executable"):
        find_vllm_python(str(text))
    text.chmod(0o755)  # no shebang, not ELF: the kernel refuses it
    with pytest.raises(VllmSetupError, match=r"^rollout\.vllm_python=.*(cannot be run|not a Python interpreter)"):
        find_vllm_python(str(text))
    with pytest.raises(VllmSetupError, match=r"not a Python interpreter"):
        find_vllm_python("/bin/true")


def test_without_vllm_python_the_repo_venv_is_found_or_the_key_is_named(tmp_path, monkeypatch):
    from april_jax.rollout.vllm import server

    found = server.find_vllm_python(None)
    assert Path(found) == ROOT / ".venv-vllm/bin/python" or found == sys.executable
    monkeypatch.setattr(server, "REPO_ROOT", tmp_path)  # a checkout without .venv-vllm
    monkeypatch.setattr(server.importlib.util, "find_spec", lambda name: None)  # and no vllm here
    with pytest.raises(server.VllmSetupError, match=r"set rollout\.vllm_python") as e:
        server.find_vllm_python(None)
    assert "\n" not in str(e.value)
