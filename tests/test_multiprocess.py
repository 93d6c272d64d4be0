"""Multi-process JAX training: configs/tiny.py as 2 processes x 4 CPU devices (gloo
collectives, started by `python -m april_jax.cli.launch`) against 1 process x 8 devices, the same
mesh. Asserts identical metrics and checkpoints, a resume of the 2-process checkpoint in one
process, that only process 0 writes the workdir's files, and the launcher's failure handling."""

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from april_jax.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # jax.distributed training runs through the launcher

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
# Small enough to compile little: sequences fit one 32-token bucket (prompts <= 24, responses <= 8)
ARGS = [
    "--config",
    str(ROOT / "configs/tiny.py"),
    "--config.warmup.steps=5",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.rollout.max_response_len=8",
    "--config.rollout.max_num_seqs=16",
    "--config.train.micro_batch_size=8",
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
    "--config.checkpoint.every=1",
    # the engine runs on 4 devices in both runs (process 0 has 4): its numerics depend on its mesh
    "--config.rollout.engine_devices=4",
]


def run_job(workdir, nprocs: int, devices: int, steps: int = STEPS, logs=None) -> None:
    """`python -m april_jax.cli.launch`: nprocs processes x devices CPU devices, one jax.distributed job.

    The 1-process reference is a jax.distributed job too, so both use gloo collectives: XLA:CPU's
    in-process collectives (a process without a distributed client) sum in another order (a
    jitted sharded sum differed from gloo's by up to 1e-5), which would make every float differ."""
    cmd = [
        sys.executable,
        "-m",
        "april_jax.cli.launch",
        "--nprocs",
        str(nprocs),
        "--cpu-devices-per-process",
        str(devices),
        *(["--log-dir", str(logs)] if logs else []),
        *ARGS,
        f"--config.workdir={workdir}",
        f"--config.train.total_steps={steps}",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, timeout=1200
    )
    if proc.returncode != 0:
        raise AssertionError(f"{nprocs} x {devices} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """(2 x 4 workdir, 1 x 8 workdir), the two jobs run side by side: they compile different
    programs (4 local devices of 8 against 8), so neither waits for the other's cache."""
    two, one = tmp_path_factory.mktemp("two_processes"), tmp_path_factory.mktemp("one_process")
    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [
            pool.submit(run_job, two, 2, 4, logs=tmp_path_factory.mktemp("launch_logs")),
            pool.submit(run_job, one, 1, 8),
        ]
        for job in jobs:
            job.result()
    return two, one


@pytest.fixture(scope="module")
def two_processes(both_runs):
    return both_runs[0]


@pytest.fixture(scope="module")
def one_process(both_runs):
    return both_runs[1]


def _timing(key: str) -> bool:
    return key.startswith("time/") or key.endswith("_s") or key.endswith("_per_s")


def restore_params(step_dir: Path) -> dict:
    """A checkpoint's params as numpy arrays (placed on one device, whatever wrote them)."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(step_dir / "params")
    tree = getattr(meta, "item_metadata", meta)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    restored = checkpointer.restore(step_dir / "params", target)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]}


def test_two_processes_match_one_process_metrics(two_processes, one_process):
    two, one = read_metrics(two_processes), read_metrics(one_process)
    assert [m["step"] for m in two] == [m["step"] for m in one] == list(range(STEPS))
    for a, b in zip(two, one):
        compared = sorted(k for k in a if not _timing(k))
        assert compared == sorted(k for k in b if not _timing(k))
        for key in ("reward/mean", "rollout/tokens", "rollout/generated_tokens", "train/loss", "train/grad_norm"):
            assert key in compared
        different = {k: (a[k], b[k]) for k in compared if a[k] != b[k]}
        assert not different, f"step {a['step']}: {different}"
    # a step whose groups all score alike is a zero update (which step that is depends on the task's
    # warm-up); the comparison only means something if some step trained on something
    assert any(m["train/grad_norm"] > 0 for m in two) and all(m["rollout/tokens"] > 0 for m in two)
    delivered = lambda w: (w / "delivered.jsonl").read_text()
    assert delivered(two_processes) == delivered(one_process)


def test_two_processes_match_one_process_checkpoints(two_processes, one_process):
    for step in range(1, STEPS + 1):
        a, b = (
            restore_params(two_processes / "checkpoints" / str(step)),
            restore_params(one_process / "checkpoints" / str(step)),
        )
        assert a.keys() == b.keys() and len(a) > 5
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"checkpoint {step}: {name}")
        meta = lambda w, step=step: json.loads((w / "checkpoints" / str(step) / "meta" / "metadata").read_text())
        ma, mb = meta(two_processes), meta(one_process)
        for m in (ma, mb):
            m["config"].pop("workdir")
        assert ma == mb


def test_only_process_0_writes_the_workdir(two_processes):
    lines = lambda name: (two_processes / name).read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines("metrics.jsonl")] == list(range(STEPS))
    assert [json.loads(l)["step"] for l in lines("delivered.jsonl")] == list(range(STEPS))
    assert json.loads((two_processes / "config.json").read_text())["workdir"] == str(two_processes)


def test_two_process_checkpoint_resumes_in_one_process(two_processes, one_process, tmp_path):
    """Checkpoint 1 of the 2-process run, resumed by one process, redoes step 1 exactly as both runs did."""
    workdir = tmp_path / "resumed"
    shutil.copytree(two_processes, workdir, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
    run_job(workdir, 1, 8)
    resumed = read_metrics(workdir)
    assert [m["step"] for m in resumed] == list(range(STEPS))
    want = read_metrics(one_process)[-1]
    got = resumed[-1]
    assert {k: v for k, v in got.items() if not _timing(k)} == {k: v for k, v in want.items() if not _timing(k)}
    a, b = (
        restore_params(workdir / "checkpoints" / str(STEPS)),
        restore_params(one_process / "checkpoints" / str(STEPS)),
    )
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_launcher_stops_every_process_when_one_fails(tmp_path):
    """Process 1 exits with 3 while process 0 hangs: the launcher stops process 0 and exits with 3."""
    env = dict(os.environ, PROBE_DIR=str(tmp_path), PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    t = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from april_jax.cli.launch import launch; "
            "sys.exit(launch(2, ['--config.x=1'], cpu_devices=4, module='launch_probe'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert time.perf_counter() - t < 60
    assert "process 1 exited with 3" in proc.stderr
    pid0 = int((tmp_path / "pid_0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)
    seen = json.loads((tmp_path / "env_1").read_text())
    assert seen["JAX_NUM_PROCESSES"] == "2" and seen["JAX_PROCESS_ID"] == "1"
    assert seen["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    assert seen["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=4")
    assert seen["argv"] == ["--config.x=1"]
