"""Bad input and faults through the real CLI: exit 2, one `error:` line naming the bad
key / file / row, no traceback, and nothing lost or changed in the workdir.

Every case is a subprocess (`python -m april_jax.train ...` / `python -m april_jax.cli.ckpt ...`). Most
fail before JAX compiles anything; all are started at once from one module fixture (a few at a
time, the 2-core CI machine is the limit) and each test waits for its own. Three real runs: a
one-step tiny run whose checkpoint the `ckpt` cases and the divergence case use, a resume of it
with a learning rate that overflows float32 behind an empty and a corrupt newer checkpoint, and a
fresh run whose reward function returns NaN.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax import assets

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny.py")
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
SMALL = [
    "--config.warmup.steps=2",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=2",
    "--config.rollout.max_num_seqs=8",
    "--config.train.micro_batch_size=4",
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
]


def train(*args) -> list[str]:
    return [sys.executable, "-m", "april_jax.train", *args]


def ckpt(*args) -> list[str]:
    return [sys.executable, "-m", "april_jax.cli.ckpt", *args]


def run(cmd, cwd=ROOT, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def snapshot(directory: Path) -> dict:
    """{relative path: sha1} of every file under `directory` (dirs as None): what 'unchanged' means."""
    out = {}
    for p in sorted(directory.rglob("*")):
        out[str(p.relative_to(directory))] = hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


def assert_one_error_line(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, the last one, naming each of `names`."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


# ---- inputs ----


def make_inputs(base: Path) -> dict:
    from hf_utils import save_tiny

    smol = assets.smollm2_135m_instruct()
    good_model = base / "hf_ok"  # a real transformers checkpoint sized for the reverse task
    save_tiny(good_model, vocab_size=16)
    bad_config = base / "hf_bad_config"
    shutil.copytree(good_model, bad_config)
    (bad_config / "config.json").write_text((good_model / "config.json").read_text()[:40])
    truncated = base / "hf_truncated"
    shutil.copytree(good_model, truncated)
    weights = (good_model / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])

    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    good = base / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    long_rows = (
        rows[:1] + [{"prompt": "Add these numbers: " + " + ".join(map(str, range(200))), "answer": "19900"}] + rows[1:]
    )
    long = base / "long.jsonl"
    long.write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    non_utf8 = base / "latin1.jsonl"
    non_utf8.write_bytes(
        json.dumps(rows[0]).encode() + b"\n" + '{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1")
    )
    fake_parquet = base / "table.parquet"
    fake_parquet.write_text("prompt,answer\n1+1,2\n")
    syntax = base / "broken_config.py"
    syntax.write_text("from april_jax.config import default_config\n\ndef get_config(:\n    return default_config()\n")

    # A previous run's workdir as this version leaves it: every failing train case must leave it as is.
    previous = base / "previous_run"
    previous.mkdir()
    (previous / "config.json").write_text('{"seed": 0}\n')
    (previous / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')
    (previous / "delivered.jsonl").write_text('{"step": 0, "uids": ["train:0"]}\n')
    (previous / ".lock").write_text("")
    no_meta = base / "foreign_ckpt" / "7"
    (no_meta / "meta").mkdir(parents=True)
    (no_meta / "meta" / "metadata").write_text('{"step": 7}')
    return dict(
        smol=str(smol),
        good_model=good_model,
        bad_config=bad_config,
        truncated=truncated,
        good=good,
        long=long,
        non_utf8=non_utf8,
        fake_parquet=fake_parquet,
        syntax=syntax,
        previous=previous,
        no_meta=no_meta,
    )


def file_task(tokenizer: str, data: Path) -> list[str]:
    return [
        "--config.data.task=file",
        f"--config.data.tokenizer_path={tokenizer}",
        f"--config.data.train_path={data}",
        "--config.warmup.steps=0",
        "--config.data.max_prompt_len=48",
    ]


# name -> (extra train args (from the inputs), names the error line must contain); workdir: fresh or a copy
CONFIG_CASES = {
    "micro_batch_size_negative": (lambda i: ["--config.train.micro_batch_size=-1"], ["'train.micro_batch_size'=-1"]),
    "warmup_batch_size_zero": (lambda i: ["--config.warmup.batch_size=0"], ["'warmup.batch_size'=0"]),
    "schedule_invalid_choice": (lambda i: ["--config.optimizer.schedule=linear"], ["'optimizer.schedule'='linear'"]),
    "reward_workers_zero": (lambda i: ["--config.reward.workers=0"], ["'reward.workers'=0"]),
    "rollout_batch_size_negative": (
        lambda i: ["--config.rollout.rollout_batch_size=-4"],
        ["rollout.rollout_batch_size=-4"],
    ),
    "lr_infinite": (lambda i: ["--config.optimizer.lr=inf"], ["'optimizer.lr'=inf"]),
    "overlong_policy_invalid": (lambda i: ["--config.data.overlong_prompt=truncate"], ["'data.overlong_prompt'"]),
}
INPUT_CASES = {
    "model_config_json_corrupt": (
        lambda i: [f"--config.model.path={i['bad_config']}"],
        ["hf_bad_config/config.json", "invalid JSON"],
    ),
    "safetensors_truncated": (
        lambda i: [f"--config.model.path={i['truncated']}"],
        ["hf_truncated/model.safetensors", "not a readable safetensors file"],
    ),
    "jsonl_not_utf8": (lambda i: file_task(i["smol"], i["non_utf8"]), ["latin1.jsonl:2", "not UTF-8"]),
    "parquet_not_parquet": (
        lambda i: file_task(i["smol"], i["fake_parquet"]),
        ["table.parquet", "not a readable parquet"],
    ),
    "prompt_longer_than_max_prompt_len": (
        lambda i: file_task(i["smol"], i["long"]),
        ["long.jsonl:2", "data.max_prompt_len=48"],
    ),
    "tokenizer_vocab_larger_than_model": (
        lambda i: file_task(i["smol"], i["good"]) + [f"--config.model.path={i['good_model']}"],
        ["49152 tokens", "only 16"],
    ),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Builds the inputs and starts every case; {name: Future} (and the paths the tests need)."""
    base = tmp_path_factory.mktemp("bad_inputs")
    inputs = make_inputs(base)
    pool = cf.ThreadPoolExecutor(max_workers=3)
    jobs, workdirs = {}, {}
    # the real runs first: they are the long poles
    jobs["trained"] = pool.submit(
        lambda: run(
            train(
                "--config",
                TINY,
                f"--config.workdir={base / 'trained'}",
                *SMALL,
                "--config.train.total_steps=1",
                "--config.checkpoint.every=1",
            )
        )
    )
    jobs["nan_reward"] = pool.submit(
        lambda: run(
            train(
                "--config",
                TINY,
                f"--config.workdir={base / 'nan_reward'}",
                *SMALL,
                *file_task(inputs["smol"], inputs["long"]),
                "--config.data.overlong_prompt=skip",
                "--config.reward.fn=tests.reward_fns:not_a_number",
                "--config.rollout.max_response_len=4",
                "--config.train.total_steps=4",
                "--config.train.max_skipped_steps=2",
            )
        )
    )
    for name, (args, _) in CONFIG_CASES.items():
        workdirs[name] = base / f"fresh_{name}"
        jobs[name] = pool.submit(run, train("--config", TINY, f"--config.workdir={workdirs[name]}", *args(inputs)))
    for name, (args, _) in INPUT_CASES.items():
        workdirs[name] = base / f"copy_{name}"
        shutil.copytree(inputs["previous"], workdirs[name])
        jobs[name] = pool.submit(
            run, train("--config", TINY, f"--config.workdir={workdirs[name]}", *SMALL, *args(inputs))
        )
    missing = base / "no_such_config.py"
    jobs["config_file_missing"] = pool.submit(run, train("--config", str(missing)))
    jobs["config_file_syntax_error"] = pool.submit(run, train("--config", str(inputs["syntax"])))
    jobs["inspect_without_april_meta"] = pool.submit(run, ckpt("inspect", str(inputs["no_meta"])))
    yield dict(jobs=jobs, workdirs=workdirs, inputs=inputs, base=base, pool=pool, missing=missing)
    pool.shutdown(wait=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_bad_config_value(launched, name):
    proc = launched["jobs"][name].result()
    line = assert_one_error_line(proc, *CONFIG_CASES[name][1])
    assert not launched["workdirs"][name].exists(), "a bad config must not create the workdir"
    if name == "rollout_batch_size_negative":
        assert "micro_batch_size" not in line


@pytest.mark.slow
@pytest.mark.parametrize("name", list(INPUT_CASES))
def test_bad_input_file_leaves_the_workdir_as_it_was(launched, name):
    proc = launched["jobs"][name].result()
    assert_one_error_line(proc, *INPUT_CASES[name][1])
    assert snapshot(launched["workdirs"][name]) == snapshot(launched["inputs"]["previous"])


@pytest.mark.slow
def test_config_file_missing_or_broken_is_named(launched):
    assert_one_error_line(launched["jobs"]["config_file_missing"].result(), str(launched["missing"]), "not found")
    assert_one_error_line(
        launched["jobs"]["config_file_syntax_error"].result(), f"{launched['inputs']['syntax']}:3", "syntax error"
    )


@pytest.mark.slow
def test_ckpt_inspect_without_april_meta(launched):
    assert_one_error_line(
        launched["jobs"]["inspect_without_april_meta"].result(),
        "foreign_ckpt/7",
        "not an april_jax checkpoint",
        "april",
    )


@pytest.fixture(scope="module")
def trained(launched):
    proc = launched["jobs"]["trained"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return launched["base"] / "trained"


@pytest.mark.slow
def test_second_trainer_on_a_locked_workdir_exits_at_once(trained):
    before = snapshot(trained)
    fd = os.open(trained / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process holds it, as a running trainer does
        proc = run(train("--config", TINY, f"--config.workdir={trained}", *SMALL, "--config.train.total_steps=2"))
    finally:
        os.close(fd)
    assert_one_error_line(proc, f"workdir {trained} is in use by another trainer")
    assert snapshot(trained) == before


@pytest.mark.slow
def test_ckpt_relative_paths_and_export_hf_targets(trained):
    base = trained.parent
    inspect = run(ckpt("inspect", "trained", "--json"), cwd=base)
    assert inspect.returncode == 0, inspect.stderr
    info = json.loads(inspect.stdout)
    assert info["step"] == 1 and info["num_params"] > 0
    assert info["num_params"] == json.loads(run(ckpt("inspect", str(trained), "--json")).stdout)["num_params"]

    export = run(ckpt("export-hf", "trained", "exported"), cwd=base)
    assert export.returncode == 0 and (base / "exported" / "model.safetensors").exists(), export.stderr
    before = snapshot(base / "exported")
    again = run(ckpt("export-hf", "trained", "exported"), cwd=base)
    assert_one_error_line(again, "exported", "not empty", "--force")
    assert snapshot(base / "exported") == before
    (base / "a_file").write_text("keep me")
    into_file = run(ckpt("export-hf", "trained", "a_file"), cwd=base)
    assert_one_error_line(into_file, "a_file", "not a directory")
    assert (base / "a_file").read_text() == "keep me"
    forced = run(ckpt("export-hf", "trained", "exported", "--force"), cwd=base)
    assert forced.returncode == 0, forced.stderr
    assert snapshot(base / "exported") == before  # the same checkpoint exported again: the same bytes


@pytest.mark.slow
def test_divergence_stops_with_the_last_good_checkpoint_intact(trained):
    """lr overflows float32 (params would become inf): every step is skipped, the run stops after
    train.max_skipped_steps with exit 2, and no checkpoint is written. Before it resumes, an empty and
    a corrupt newer checkpoint are set aside (kept) with one line each, not a crash."""
    workdir = trained.parent / "diverged"
    shutil.copytree(trained, workdir)
    checkpoints = workdir / "checkpoints"
    shutil.copytree(checkpoints / "1", checkpoints / "8")
    for f in (checkpoints / "8" / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0" * 16)  # corrupt
    (checkpoints / "9").mkdir()  # empty
    good = snapshot(checkpoints / "1")
    proc = run(
        train(
            "--config",
            TINY,
            f"--config.workdir={workdir}",
            *SMALL,
            "--config.train.total_steps=5",
            "--config.checkpoint.every=1",
            "--config.optimizer.lr=1e39",
            "--config.train.max_skipped_steps=2",
        )
    )
    assert_one_error_line(
        proc, "stopped after 2 skipped steps", "non-finite", f"last good checkpoint: {checkpoints / '1'}"
    )
    for step in (9, 8):
        assert f"warning: checkpoint {checkpoints / str(step)} is unreadable" in proc.stderr
    assert "resumed from" in proc.stderr and "(step 1," in proc.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1"], "a skipped step wrote a checkpoint"
    assert snapshot(checkpoints / "1") == good
    assert sorted(p.name for p in (workdir / "checkpoints.unreadable").iterdir()) == ["8", "9"], (
        "set aside, not deleted"
    )
    rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/skipped"] == 1 for r in rows[1:])


@pytest.mark.slow
def test_truncated_checkpoint_data_is_one_warning_line(trained):
    """Parameter data files cut to 0 bytes (a disk that filled, a copy cut short): the checkpoint is
    set aside in one line, without orbax's abandoned reads' tracebacks or TensorStore's spec."""
    workdir = trained.parent / "truncated"
    shutil.copytree(trained, workdir)
    checkpoints = workdir / "checkpoints"
    shutil.copytree(checkpoints / "1", checkpoints / "5")
    data = [f for f in (checkpoints / "5" / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for f in data:
        f.write_bytes(b"")
    proc = run(train("--config", TINY, f"--config.workdir={workdir}", *SMALL, "--config.train.total_steps=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and "is unreadable" in warning[0] and "resuming from step 1" in warning[0], warning
    assert "Exception ignored" not in proc.stderr and "TensorStore" not in proc.stderr, proc.stderr[-3000:]
    assert (workdir / "checkpoints.unreadable" / "5").is_dir()


@pytest.mark.slow
def test_nan_reward_on_every_sample_stops_the_run(launched):
    """A reward function returning NaN: each score counts as a failure (reward 0, reward/failures),
    a step where every reward failed trains nothing, and two in a row stop the run. The same data
    file has one prompt over data.max_prompt_len, skipped with a count (overlong_prompt=skip); the
    tiny model is sized to the 49k-token tokenizer."""
    proc = launched["jobs"]["nan_reward"].result()
    assert_one_error_line(
        proc, "stopped after 2 skipped steps", "every reward failed", "last good checkpoint: none written"
    )
    assert "data.overlong_prompt=skip: skipped 1 of 9 prompts" in proc.stderr and "long.jsonl:2" in proc.stderr
    workdir = launched["base"] / "nan_reward"
    rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["train/skipped"] == 1 and r["reward/failures"] > 0 for r in rows)
    assert not any((workdir / "checkpoints").iterdir())


def test_an_unusable_compile_cache_folder_is_one_line_and_no_workdir(tmp_path):
    """The key's folder cannot be made (a file is in its path): one line naming key and folder,
    before the workdir is touched. The test session's JAX_COMPILATION_CACHE_DIR would win, so it is unset."""
    (tmp_path / "a_file").write_text("")
    folder, workdir = tmp_path / "a_file" / "xla", tmp_path / "run"
    env = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.run(
        train(
            "--config",
            str(ROOT / "configs/tiny.py"),
            f"--config.workdir={workdir}",
            f"--config.train.compile_cache_dir={folder}",
            *SMALL,
        ),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert_one_error_line(proc, "train.compile_cache_dir", str(folder))
    assert not workdir.exists()
