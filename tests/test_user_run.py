"""One short real run as a user would make it: chat-message rows from a jsonl file, a custom
reward that reads the sample (and hangs on one row), W&B offline beside JSONL and TensorBoard,
then the dashboard plot of that run."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # a training run through the CLI

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2


def chat_rows(n):
    return [
        {
            "prompt": [
                {"role": "system", "content": "You count."},
                {"role": "user", "content": f"What comes after {i}?"},
            ],
            "answer": str(i + 1),
            "level": i + 1,
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("user_run")
    data = base / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(8)))
    workdir = base / "run"
    cmd = [
        sys.executable,
        "-m",
        "april_jax.train",
        "--config",
        str(ROOT / "configs/tiny.py"),
        f"--config.workdir={workdir}",
        "--config.data.task=file",
        f"--config.data.train_path={data}",
        f"--config.data.eval_path={data}",
        "--config.data.tokenizer_path=asset:smollm2-135m-instruct",
        "--config.data.max_prompt_len=64",
        '--config.data.chat_template_kwargs={"enable_thinking": false}',
        "--config.reward.fn=tests.reward_fns:chat_run",
        "--config.reward.timeout_s=1.0",
        "--config.warmup.steps=0",
        "--config.rollout.rollout_batch_size=2",
        "--config.rollout.n_samples_per_prompt=4",
        "--config.rollout.over_sampling_batch_size=4",
        "--config.rollout.max_response_len=12",
        "--config.rollout.max_num_seqs=16",
        "--config.train.micro_batch_size=8",
        f"--config.train.total_steps={STEPS}",
        "--config.eval.every=2",
        "--config.eval.num_prompts=8",
        "--config.eval.n_samples=2",
        "--config.log.wandb_project=april-jax-test",
        "--config.log.wandb_mode=offline",
        "--config.log.progress=false",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", WANDB_SILENT="true")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_chat_rows_train_and_the_reward_gets_the_sample(run):
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["train/loss"] == r["train/loss"]  # finite
        assert r["reward/mean"] >= 0, "a reward saw a sample without its messages or fields (-1)"
    delivered = [u for l in (run / "delivered.jsonl").read_text().splitlines() for u in json.loads(l)["uids"]]
    assert len(delivered) == 2 * STEPS


def test_stuck_reward_is_killed_counted_and_the_run_exits(run):
    # eval covers all 8 rows x 2 samples, so the row with answer 7 hung twice in eval alone;
    # every other eval sample was scored (its reward is 0 or 1, never the -1 of a bad sample)
    last = read_metrics(run)[-1]
    assert last["reward/timeouts"] >= 2 and last["reward/failures"] == 0
    assert 0 < last["eval/avg@2"] <= 14 / 16


def read_tensorboard_tags(logdir: Path) -> set[str]:
    """Scalar tags from tfevents files (the TFRecord framing, read without TensorFlow)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for file in logdir.glob("events.out.tfevents.*"):
        data = file.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = Event.FromString(data[i + 12 : i + 12 + n])
            tags |= {v.tag for v in event.summary.value}
            i += 12 + n + 4
    return tags


def read_wandb_records(file: Path):
    """Records of a W&B run file: a 7-byte ':W&B' header, then LevelDB-log framing (32 KiB blocks,
    chunks of crc32(4) length(2) type(1): 1 full, 2 first, 3 middle, 4 last) of protobuf Records."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, block, chunks = file.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield Record.FromString(chunks)
            chunks = b""


def test_metric_names_are_identical_in_jsonl_tensorboard_and_wandb(run):
    names = set().union(*(r.keys() for r in read_metrics(run))) - {"step"}
    tb = read_tensorboard_tags(run / "tensorboard")
    assert "eval/avg@2" in tb and names <= tb, sorted(names - tb)
    [offline] = (run / "wandb").glob("offline-run-*")
    [records] = offline.glob("run-*.wandb")
    assert records.stat().st_size > 0
    logged = {
        item.key or "/".join(item.nested_key)
        for rec in read_wandb_records(records)
        if rec.WhichOneof("record_type") == "history"
        for item in rec.history.item
    }
    assert names <= logged, sorted(names - logged)


def test_dashboard_png_from_the_run(run, tmp_path):
    out = tmp_path / "dash.png"
    proc = subprocess.run(
        [sys.executable, "-m", "april_jax.cli.plot", str(run), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] > 600 and image.shape[1] > 900
