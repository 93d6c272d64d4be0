"""End to end: the training CLI on configs/tiny.py, resume after kill -9, ckpt inspect/export, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from april_jax.cli.ckpt import ORBAX_SNIPPET, describe
from april_jax.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--config.warmup.steps=5",
    "--config.rollout.rollout_batch_size=4",
    "--config.rollout.over_sampling_batch_size=8",
    "--config.rollout.n_samples_per_prompt=4",
    "--config.rollout.max_num_seqs=32",
    "--config.train.micro_batch_size=16",
    "--config.eval.num_prompts=4",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
]
KEYS = [
    "step",
    "rollout/time_s",
    "rollout/tokens_per_s",
    "rollout/occupancy",
    "rollout/aborted",
    "rollout/resumed",
    "rollout/off_policy_token_frac",
    "rollout/staleness_max",
    "rollout/staleness_mean",
    "rollout/response_len/mean",
    "rollout/response_len/max",
    "rollout/response_len/p50",
    "rollout/truncated_frac",
    "reward/mean",
    "reward/zero_std_groups",
    "train/loss",
    "train/pg_clipfrac",
    "train/ppo_kl",
    "train/entropy",
    "train/grad_norm",
    "train/is_ratio_mean",
    "train/tis_clipfrac",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
]


def train_cmd(workdir, *extra):
    return [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        *SMALL,
        *extra,
    ]


def run_train(workdir, *extra, check=True):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run(train_cmd(workdir, *extra), capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


STEPS = 8  # room after checkpoint 2 so that the kill lands mid-run even on a fast machine
RUN = [f"--config.train.total_steps={STEPS}", "--config.checkpoint.every=1", "--config.eval.every=2"]


def wall_clock(key: str) -> bool:
    """The only metrics a resume may change: durations and rates (time/*, *_s, *_per_s)."""
    return key.startswith("time/") or key.endswith("_s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One run of STEPS steps: the metrics tests read it and the kill -9 test compares against it."""
    workdir = tmp_path_factory.mktemp("tiny")
    run_train(workdir, *RUN)
    return workdir


@pytest.mark.slow
def test_run_writes_named_metrics(uninterrupted):
    rows = read_metrics(uninterrupted)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for key in KEYS:
        assert key in rows[0], key
    assert "eval/avg@2" in rows[1] and 0 <= rows[1]["eval/avg@2"] <= 1
    assert json.loads((uninterrupted / "config.json").read_text())["rollout"]["engine"] == "jax"


@pytest.mark.slow
def test_ckpt_inspect_and_export_hf(uninterrupted, tmp_path):
    info = describe(uninterrupted)
    assert info["step"] == STEPS and info["policy_version"] == STEPS
    names = {p["name"]: p for p in info["params"]}
    assert names["layers.0.mlp.up_proj.weight"]["shape"] == [128, 64]
    assert info["buffer"]["groups"] >= 0 and "tokens" in info["buffer"]
    cli = subprocess.run(
        [sys.executable, "-m", "april_jax.cli.ckpt", "inspect", str(uninterrupted), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert cli.returncode == 0 and json.loads(cli.stdout)["step"] == STEPS

    # the README's plain-orbax snippet, as written there
    snippet = ORBAX_SNIPPET.replace("CHECKPOINTS_DIR", repr(str(uninterrupted / "checkpoints")))
    assert ORBAX_SNIPPET.replace("CHECKPOINTS_DIR", '"runs/tiny/checkpoints"') in (ROOT / "README.md").read_text()
    lines = snippet.splitlines()
    plain = subprocess.run(
        [sys.executable, "-c", "\n".join([*lines[:-1], f"print(({lines[-1]})[0].shape, ({lines[-1]})[1])"])],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert plain.returncode == 0 and plain.stdout.split() == ["(16,", "64)", str(STEPS)], plain.stderr[-2000:]
    export = subprocess.run(
        [sys.executable, "-m", "april_jax.cli.ckpt", "export-hf", str(uninterrupted), str(tmp_path / "hf")],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert f"(step {STEPS} of {uninterrupted})" in export.stdout
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    from april_jax.models import hf

    ours = hf.from_pretrained(tmp_path / "hf")
    ids = np.array([[1, 3, 5, 6, 7, 4]])
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours(jnp.asarray(ids, jnp.int32))) - ref).max() < 1e-4


@pytest.mark.slow
def test_kill_9_then_resume_is_identical_to_an_uninterrupted_run(uninterrupted, tmp_path):
    """SIGKILL after checkpoint 2, resume: every metric but wall-clock time equals the uninterrupted
    run's (params, optimiser, data order, APRIL buffer and the engine's sampling seeds all restored)."""
    workdir = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.Popen(
        train_cmd(workdir, *RUN),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (workdir / "checkpoints" / "2" / "commit_success.txt").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "no checkpoint 2 in time"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in read_metrics(workdir))
    assert killed_at < STEPS - 1, "the run finished before it was killed"

    resumed = run_train(workdir, *RUN)
    assert "resumed from" in resumed.stderr
    assert f"XLA compilation cache: {os.environ['JAX_COMPILATION_CACHE_DIR']} " in resumed.stderr
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(STEPS)), "metrics continue without gaps or repeats"
    assert rows[-1]["version"] == STEPS
    strip = lambda r: {k: v for k, v in r.items() if not wall_clock(k)}
    for got, want in zip(rows, read_metrics(uninterrupted)):
        assert strip(got) == strip(want), f"step {got['step']} differs after the resume"
    delivered = [json.loads(l) for l in (workdir / "delivered.jsonl").read_text().splitlines()]
    assert delivered == [json.loads(l) for l in (uninterrupted / "delivered.jsonl").read_text().splitlines()]
    uids = [u for d in delivered for u in d["uids"]]
    assert len(uids) == len(set(uids)) == STEPS * 4, "a prompt was trained twice"
    info = describe(workdir)
    drawn = info["data_position"]["position"]
    # every drawn prompt is trained, still in the buffer, or counted as dropped: none skipped
    assert len(uids) + info["buffer"]["groups"] + info["dropped_prompts"] == drawn


def test_configs_parse_and_validate():
    from april_jax.config.loading import load_config

    for name in ("tiny", "qwen3_4b", "qwen3_8b"):
        c = load_config(["x", "--config", str(ROOT / f"configs/{name}.py")])
        assert c.rollout.rollout_batch_size > 0
    c = load_config(
        ["x", "--config", str(ROOT / "configs/qwen3_4b.py"), "--config.rollout.over_sampling_batch_size=96"]
    )
    assert (c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt, c.rollout.over_sampling_batch_size) == (
        32,
        8,
        96,
    )
    assert c.rollout.temperature == 0.8 and c.optimizer.lr == 1e-6 and c.rollout.max_response_len == 16384
    assert (
        (c.model.dtype, c.model.compute_dtype) == ("float32", "bfloat16")
        and c.rollout.engine == "vllm"
        and c.model.remat == "full"
    )
    assert load_config(["x", "--config", str(ROOT / "configs/qwen3_8b.py")]).mesh.tensor == 2
    from april_jax.config import ConfigError

    for flag, message in (
        ("rollout.weight_transport=nccl", "'rollout.weight_transport'='nccl': expected one of"),
        ("rollout.decode_steps_per_call=0", "'rollout.decode_steps_per_call'=0: must be > 0"),
        ("model.remat=always", "'model.remat'='always': expected one of"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(["x", "--config", str(ROOT / "configs/tiny.py"), f"--config.{flag}"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--config.rollout.over_sampling_batchsize=64"],
            "unknown config key 'rollout.over_sampling_batchsize'; did you mean --config.rollout.over_sampling_batch_size?",
        ),
        (["--config.train.total_steps=ten"], "config key 'train.total_steps' expects int, got 'ten'"),
        (
            ["--config.rollout.over_sampling_batch_size=2"],
            "rollout.over_sampling_batch_size=2: must be >= rollout.rollout_batch_size=4",
        ),
        (["--config.rollout.engine=tpu"], "config key 'rollout.engine'='tpu'"),
        (["--config.train.micro_batch_size=5"], "config key 'train.micro_batch_size'=5 does not divide the batch"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, extra, message):
    proc = run_train(tmp_path / "w", *extra, check=False)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1] == f"error: {message}" or message in proc.stderr.strip().splitlines()[-1]
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "w").exists(), "nothing may be written for a bad config"


def test_bad_dataset_rows_name_file_and_line(tmp_path):
    good = tmp_path / "data.jsonl"
    good.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?" "answer": "4"}\n')
    from april_jax.data.dataset import DataError, read_rows

    with pytest.raises(DataError, match=r"data.jsonl:2: invalid JSON"):
        read_rows(str(good), "prompt", "answer")
    good.write_text('{"prompt": "1+1?", "answer": "2"}\n{"question": "x", "answer": "4"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: row lacks field 'prompt'"):
        read_rows(str(good), "prompt", "answer")
    with pytest.raises(DataError, match="missing.jsonl: dataset file not found"):
        read_rows(str(tmp_path / "missing.jsonl"), "prompt", "answer")


def test_missing_dataset_file_and_missing_checkpoint_fail_cleanly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "april_jax.train",
            "--config",
            str(ROOT / "configs/qwen3_4b.py"),
            f"--config.workdir={tmp_path / 'w'}",
            f"--config.model.path={tmp_path / 'nockpt'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    cli = subprocess.run(
        [sys.executable, "-m", "april_jax.cli.ckpt", "inspect", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert cli.returncode == 2 and cli.stderr.strip() == f"error: {tmp_path / 'none'}: checkpoint not found"


SMOKE = "test_smollm2_gsm8k_one_step_smoke"


@pytest.fixture(scope="module", autouse=True)
def smollm2_smoke_run(request, tmp_path_factory):
    """(workdir, process, stderr file) of the SmolLM2 smoke run, started with the module when its test
    is selected: its minutes of mostly single-threaded compiling overlap the tiny runs above."""
    if not any(item.name == SMOKE for item in request.session.items):
        yield None
        return
    workdir = tmp_path_factory.mktemp("smol") / "w"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/smollm2_gsm8k.py"),
        f"--config.workdir={workdir}",
        "--config.train.total_steps=1",
        "--config.rollout.rollout_batch_size=1",
        "--config.rollout.n_samples_per_prompt=2",
        "--config.rollout.over_sampling_batch_size=2",
        "--config.rollout.max_response_len=32",
        "--config.train.micro_batch_size=2",
        "--config.log.tensorboard=false",
        "--config.eval.num_prompts=4",
    ]  # the step-0 greedy eval on 4 of the GSM8K problems, not all 100
    with open(workdir.parent / "stderr", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, cwd=ROOT)
        try:
            yield workdir, proc, err
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.slow
def test_smollm2_gsm8k_one_step_smoke(smollm2_smoke_run):
    """Real weights (SmolLM2-135M-Instruct), real data (GSM8K test problems), math-verify rewards."""
    workdir, proc, err = smollm2_smoke_run
    returncode = proc.wait(timeout=900)
    err.seek(0)
    assert returncode == 0, err.read()[-3000:]
    [row] = read_metrics(workdir)
    assert row["rollout/groups"] == 1 and row["rollout/tokens"] > 0 and np.isfinite(row["train/loss"])
    assert describe(workdir)["step"] == 1


def test_chat_tokenizer_renders_the_checkpoint_template():
    from april_jax import assets
    from april_jax.data.tokenizer import load_tokenizer

    path = assets.smollm2_135m_instruct()
    tok = load_tokenizer(str(path))
    ref = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tok.encode_prompt("What is 2+2?") == expected
    assert ref.convert_tokens_to_ids("<|im_end|>") in tok.stop_ids
