"""The optimizer state on the host during rollout (`train.offload`): the round trip is bit for bit,
on the same shardings; checkpoints save it whether it is on the host or the device; a tiny run
with offload on equals one without, metric for metric."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from april_jax import train as train_lib
from april_jax.models import qwen3, sharding
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer
from april_jax.runtime.checkpoints import Checkpointer
from april_jax.runtime.errors import Stopped
from april_jax.training.metrics import read_metrics
from tiny_models import TINY_QWEN3

ROOT = Path(__file__).resolve().parents[1]
LOSS = LossConfig(loss_agg_mode="token-mean", kl_coef=0.0, max_staleness=3, staleness_decay=0.9)


def random_batch(B=8, S=12, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S - 1), np.float32)
    mask[:, 3:] = 1
    return {
        "input_ids": rng.integers(0, TINY_QWEN3.vocab_size, (B, S)).astype(np.int32),
        "loss_mask": mask,
        "behaviour_logp": -rng.uniform(3.5, 4.5, (B, S - 1)).astype(np.float32),
        "versions": rng.integers(2, 5, (B, S - 1)).astype(np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def host(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def assert_bits_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) and len(a) > 5
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit for bit (NaN payloads and signed zeros included)


def stepped_trainer(mesh=None) -> Trainer:
    """A trainer one optimizer step in: its AdamW moments are not zeros."""
    trainer = Trainer(qwen3.init_model(TINY_QWEN3, seed=3, mesh=mesh), LOSS, OptimizerConfig(lr=1e-3), mesh=mesh)
    trainer.step(random_batch(B=8, seed=1), 4)
    return trainer


MESHES = [None, {"data": 2, "fsdp": 2, "tensor": 2}]


@pytest.mark.parametrize("axes", MESHES, ids=["one-device", "mesh-2x2x2"])
def test_round_trip_is_bit_identical_on_the_same_shardings(axes):
    mesh = sharding.make_mesh(axes) if axes else None
    trainer, twin = stepped_trainer(mesh), stepped_trainer(mesh)
    shardings = jax.tree.map(lambda x: x.sharding, trainer.opt_state)
    before, params = host(trainer.opt_state), host(trainer.params)
    device_leaves = jax.tree.leaves(trainer.opt_state)

    trainer.offload_optimizer()
    assert trainer.optimizer_offloaded
    assert all(x.is_deleted() for x in device_leaves), "the device buffers are freed"
    assert {x.sharding.memory_kind for x in jax.tree.leaves(trainer.opt_state)} == {"pinned_host"}
    with pytest.raises(RuntimeError, match="restore_optimizer"):
        trainer.step(random_batch(B=8, seed=2), 5)
    trainer.offload_optimizer()  # twice: a no-op

    trainer.restore_optimizer()
    assert not trainer.optimizer_offloaded
    assert jax.tree.structure(trainer.opt_state) == jax.tree.structure(twin.opt_state)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, trainer.opt_state)) == jax.tree.leaves(shardings)
    assert_bits_equal(host(trainer.opt_state), before)
    assert_bits_equal(host(trainer.params), params)

    # the next update equals the one of a twin whose state never left the device
    a, b = trainer.step(random_batch(B=8, seed=2), 5), twin.step(random_batch(B=8, seed=2), 5)
    assert a == b
    assert_bits_equal(host(trainer.params), host(twin.params))
    assert_bits_equal(host(trainer.opt_state), host(twin.opt_state))


def test_numpy_copy_where_the_backend_has_no_host_memory_kind(monkeypatch):
    monkeypatch.setattr(Trainer, "_host_memory_kind", staticmethod(lambda: None))
    trainer = stepped_trainer()
    before = host(trainer.opt_state)
    trainer.offload_optimizer()
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(trainer.opt_state))
    trainer.restore_optimizer()
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(trainer.opt_state))
    assert_bits_equal(host(trainer.opt_state), before)


class FakeEngine:
    """What train.py's save path calls on an engine, recorded."""

    def __init__(self, trainer):
        self.trainer, self.calls = trainer, []

    def sleep(self):
        self.calls.append(("sleep", self.trainer.optimizer_offloaded))

    def wake_up(self):
        self.calls.append(("wake_up", self.trainer.optimizer_offloaded))

    def release_held(self):
        self.calls.append(("release_held", self.trainer.optimizer_offloaded))

    def abort_all(self):
        self.calls.append(("abort_all", self.trainer.optimizer_offloaded))
        return []


def fake_run(trainer, ckpt, engine=None):
    c = SimpleNamespace(checkpoint=SimpleNamespace(every=1), train=SimpleNamespace(total_steps=9))
    meta = lambda step: {"step": step}
    return SimpleNamespace(
        c=c,
        trainer=trainer,
        ckpt=ckpt,
        engine=engine,
        state=SimpleNamespace(meta=meta),
        stop=SimpleNamespace(signum=None),
        save_due=False,
        last_good=None,
        finished=lambda: meta(3),
    )


def restored_opt_state(ckpt: Checkpointer, step: int, trainer: Trainer) -> list[np.ndarray]:
    _, opt_state, _ = ckpt.restore(step, trainer.params, trainer.opt_state)
    return host(opt_state)


def test_scheduled_save_while_offloaded_writes_the_device_state(tmp_path):
    trainer = stepped_trainer()
    want = host(trainer.opt_state)
    trainer.offload_optimizer()
    engine = FakeEngine(trainer)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    try:
        run = fake_run(trainer, ckpt, engine)
        assert "time/ckpt_s" in train_lib._save_if_due(run, 1, skipped=False)
        # the engine's KV went while the state was on the device; both are back as they were
        assert engine.calls == [("sleep", True), ("wake_up", True), ("release_held", True)]
        assert trainer.optimizer_offloaded
        ckpt.manager.wait_until_finished()
        trainer.restore_optimizer()
        assert_bits_equal(restored_opt_state(ckpt, 1, trainer), want)
    finally:
        ckpt.close()


def test_stop_signal_save_while_offloaded(tmp_path):
    trainer = stepped_trainer()
    want = host(trainer.opt_state)
    trainer.offload_optimizer()
    engine = FakeEngine(trainer)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    try:
        with pytest.raises(Stopped):
            train_lib._stop(fake_run(trainer, ckpt, engine), 15)
        # the rollout given up, the engine's KV freed, then the state back on the device for the save
        assert engine.calls == [("abort_all", True), ("sleep", True)]
        assert not trainer.optimizer_offloaded
        assert_bits_equal(restored_opt_state(ckpt, 3, trainer), want)
    finally:
        ckpt.close()


def test_orbax_saves_a_host_resident_state_as_the_device_one(tmp_path):
    """Saving the host copy as it is (what `offload_optimizer` promises) restores to the same bits."""
    trainer = stepped_trainer(sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2}))
    want = host(trainer.opt_state)
    trainer.offload_optimizer()
    path = tmp_path / "opt_state"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, trainer.opt_state)
        checkpointer.wait_until_finished()
        trainer.restore_optimizer()
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trainer.opt_state)
        assert_bits_equal(host(checkpointer.restore(path, target)), want)


# ---- a tiny run through the CLI, offload on and off ----
RUN = [
    "--config.warmup.steps=2",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=2",
    "--config.rollout.max_num_seqs=8",
    "--config.train.micro_batch_size=4",
    "--config.train.total_steps=3",
    "--config.checkpoint.every=1",  # every step saves, the state on the host
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
]


def run_tiny(workdir: Path, offload: str) -> None:
    cmd = [sys.executable, "-m", "april_jax.train", "--config", str(ROOT / "configs/tiny.py")]
    cmd += [f"--config.workdir={workdir}", f"--config.train.offload={offload}", *RUN]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def checkpoint_leaves(step_dir: Path, item: str) -> list[np.ndarray]:
    with ocp.StandardCheckpointer() as checkpointer:
        meta = checkpointer.metadata(step_dir / item)
        tree = getattr(meta, "item_metadata", meta)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
        return host(checkpointer.restore(step_dir / item, target))


@pytest.mark.slow  # two training runs through the CLI
def test_a_run_with_offload_equals_one_without(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    run_tiny(off, "off")
    run_tiny(on, "on")
    assert json.loads((on / "plan.json").read_text())["trainer"]["offload"] is True
    assert json.loads((off / "plan.json").read_text())["trainer"]["offload"] is False
    wall_clock = lambda k: k.startswith("time/") or k.endswith("_s") or k.endswith("_per_s")
    got, want = read_metrics(on), read_metrics(off)
    assert [r["step"] for r in got] == [0, 1, 2]
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if not wall_clock(k)} == {k: v for k, v in b.items() if not wall_clock(k)}
    for item in ("params", "opt_state"):  # saved while the state was on the host: the same bits
        assert_bits_equal(checkpoint_leaves(on / "checkpoints/3", item), checkpoint_leaves(off / "checkpoints/3", item))
