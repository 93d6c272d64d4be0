"""Bad input around the training loop, through the real CLI: the workdir (empty, a file, under a
file, read-only, a full disk), config files whose get_config() misbehaves, a resume whose shapes
changed or whose checkpoint meta is damaged, a run that ends on skipped steps, `ckpt export-hf`
into the run's own checkpoints, and `plot` on a torn metrics.jsonl or with --out a folder.

Each case: exit 2 and one `error:` line naming the bad thing (or a warning where the work goes on),
no traceback, nothing lost. The cases start at once from one module fixture (two at a time on the
2-core CI machine); two real tiny runs: a one-step run whose workdir the resume cases copy, and a
run whose warm-up diverges. The read-only and full-disk cases mount a small tmpfs (skipped where
this process may not mount).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def module(name: str, *args) -> list[str]:
    return [sys.executable, "-m", f"april_jax.{name}", *map(str, args)]


def train(workdir, *args) -> list[str]:
    return module("train", "--config", TINY, f"--config.workdir={workdir}", *SMALL, *args)


def run(cmd, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=900)


def snapshot(directory: Path) -> dict:
    return {
        str(p.relative_to(directory)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
    }


def one_error_line(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, the last one, naming each of `names`."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def config_file(path: Path, body: str) -> Path:
    path.write_text("import sys\nfrom april_jax.config import default_config\n\n\ndef get_config():\n" + body)
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_inputs_run")
    model_dir = base / "a_model"  # a folder a user runs from: an empty workdir must not write into it
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3"}\n')
    (base / "a_file").write_text("not a folder")
    returns_none = config_file(base / "returns_none.py", "    c = default_config()\n")
    returns_dict = config_file(base / "returns_dict.py", "    return {'workdir': 'x'}\n")
    exits = config_file(base / "exits.py", "    sys.exit(0)\n")
    pool = cf.ThreadPoolExecutor(max_workers=2)
    jobs = {  # the real runs first: they are the long poles
        "trained": pool.submit(run, train(base / "trained", "--config.train.total_steps=1")),
        "diverged_warmup": pool.submit(
            run,
            train(
                base / "diverged",
                "--config.warmup.lr=1e30",
                "--config.train.total_steps=2",
                "--config.train.max_skipped_steps=3",
            ),
        ),
        "workdir_empty": pool.submit(run, module("train", "--config", TINY, "--config.workdir=", *SMALL), model_dir),
        "workdir_file": pool.submit(run, train(base / "a_file")),
        "workdir_under_file": pool.submit(run, train(base / "a_file" / "run")),
        "get_config_none": pool.submit(run, module("train", "--config", returns_none)),
        "get_config_dict": pool.submit(run, module("train", "--config", returns_dict)),
        "get_config_exit": pool.submit(run, module("train", "--config", exits, "--config.seed=1")),
    }
    yield dict(base=base, jobs=jobs, model_dir=model_dir, configs=(returns_none, returns_dict, exits))
    pool.shutdown(wait=True)


@pytest.mark.slow
def test_empty_workdir_is_refused_and_the_current_folder_untouched(cases):
    before = snapshot(cases["model_dir"])
    one_error_line(cases["jobs"]["workdir_empty"].result(), "'workdir' is empty")
    assert snapshot(cases["model_dir"]) == before


@pytest.mark.slow
def test_workdir_that_is_or_is_under_a_file(cases):
    base = cases["base"]
    one_error_line(cases["jobs"]["workdir_file"].result(), str(base / "a_file"), "is a file")
    one_error_line(
        cases["jobs"]["workdir_under_file"].result(),
        str(base / "a_file" / "run"),
        f"under {base / 'a_file'}, which is a file",
    )
    assert (base / "a_file").read_text() == "not a folder"


@pytest.mark.slow
def test_get_config_that_returns_no_config_or_exits(cases):
    none, as_dict, exits = cases["configs"]
    one_error_line(cases["jobs"]["get_config_none"].result(), str(none), "returned NoneType")
    one_error_line(cases["jobs"]["get_config_dict"].result(), str(as_dict), "returned dict")
    one_error_line(cases["jobs"]["get_config_exit"].result(), str(exits), "sys.exit(0)")


@pytest.fixture(scope="module")
def trained(cases):
    proc = cases["jobs"]["trained"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cases["base"] / "trained"


def copy_run(trained: Path, name: str) -> Path:
    target = trained.parent / name
    shutil.copytree(trained, target)
    return target


@pytest.mark.slow
def test_resume_with_other_shapes_names_the_keys(trained):
    workdir = copy_run(trained, "reshaped")
    before = snapshot(workdir)
    samples = run(train(workdir, "--config.train.total_steps=2", "--config.rollout.n_samples_per_prompt=4"))
    one_error_line(samples, str(workdir / "checkpoints" / "1"), "rollout.n_samples_per_prompt: 2 -> 4")
    bigger = run(train(workdir, "--config.train.total_steps=2", "--config.model.tiny.hidden_size=96"))
    line = one_error_line(bigger, "hidden_size: 64 -> 96")
    assert len(bigger.stderr.splitlines()) < 6, bigger.stderr[-3000:]
    assert snapshot(workdir) == before, line


@pytest.mark.slow
def test_damaged_checkpoint_meta_is_one_line(trained):
    workdir = copy_run(trained, "damaged_meta")
    meta_file = workdir / "checkpoints" / "1" / "meta" / "metadata"
    meta_file.write_text(json.dumps(dict(json.loads(meta_file.read_text()), step="two")))
    one_error_line(run(module("cli.ckpt", "inspect", workdir)), "checkpoints/1", "step='two'")
    resumed = run(train(workdir, "--config.train.total_steps=2"))
    one_error_line(resumed, str(workdir / "checkpoints" / "1"), "step='two'", "no older checkpoint")
    assert meta_file.exists(), "the only checkpoint stays where it was"


@pytest.mark.slow
def test_export_into_the_runs_checkpoints_is_refused(trained):
    target = trained / "checkpoints" / "1" / "hf_export"
    one_error_line(run(module("cli.ckpt", "export-hf", trained, target)), str(target), "checkpoints folder")
    assert not target.exists()


@pytest.mark.slow
def test_a_run_ending_on_skipped_steps_fails_with_one_line(cases):
    """The warm-up diverges (lr 1e30): both RL steps are skipped, fewer than train.max_skipped_steps;
    the run does not report success (a rerun with the same config would skip the warm-up it needs to
    redo, so no checkpoint of the diverged warm-up is written either)."""
    proc = cases["jobs"]["diverged_warmup"].result()
    one_error_line(proc, "ended on 2 skipped step(s)", "non-finite", "last good checkpoint: none written")
    workdir = cases["base"] / "diverged"
    assert not any((workdir / "checkpoints").iterdir())
    assert [json.loads(l)["train/skipped"] for l in (workdir / "metrics.jsonl").read_text().splitlines()] == [1, 1]


@pytest.fixture
def tmpfs(tmp_path):
    """A 3 MB tmpfs at tmp_path/mnt (root only; unmounted afterwards)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full or read-only disk to test on")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.slow
def test_full_disk_and_read_only_workdir_are_one_line_and_keep_the_checkpoint(trained, tmpfs):
    workdir = tmpfs / "run"
    shutil.copytree(trained, workdir, ignore=shutil.ignore_patterns(".lock"))
    good = snapshot(workdir / "checkpoints" / "1")
    free = shutil.disk_usage(tmpfs).free
    (tmpfs / "filler").write_bytes(b"\0" * (free - 150 * 1024))  # room for the logs, not for checkpoint 2
    full = run(train(workdir, "--config.train.total_steps=3", "--config.checkpoint.every=1"))
    one_error_line(full, str(workdir / "checkpoints" / "2"), "No space left on device", "rerun the same command")
    assert snapshot(workdir / "checkpoints" / "1") == good

    (tmpfs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    read_only = run(train(workdir, "--config.train.total_steps=3"))
    one_error_line(read_only, f"'workdir'={str(workdir)!r}", "not writable")


def test_plot_of_a_torn_metrics_file_and_out_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": i, "reward/mean": 0.1 * i, "train/loss": 1.0 - 0.1 * i} for i in range(3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    out = tmp_path / "plots"
    out.mkdir()
    proc = run(module("cli.plot", run_dir, "--out", out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "metrics.jsonl:4: incomplete last line" in proc.stderr and "plotting the 3 complete steps" in proc.stderr
    assert proc.stdout.strip() == f"wrote {out / 'dashboard.png'}" and (out / "dashboard.png").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "run"], "nothing written beside the folder"

    one_error_line(run(module("cli.plot", run_dir, "--out", tmp_path / "dash.pdf")), "dash.pdf", ".png")
    (run_dir / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n{oops\n" + json.dumps(rows[1]) + "\n")
    one_error_line(run(module("cli.plot", run_dir)), "metrics.jsonl:2", "not a metrics record")
