"""LoRA: adapters on a frozen base. A fresh adapter is the base exactly; gradients and optimiser
state are the adapters' only; the KL reference is the base with adapters off; the merged weights
equal the adapter forward; PEFT loads the export onto the transformers base with our logits; a
LoRA run through the CLI finishes, resumes identically and exports; bad keys fail in one line."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import config as config_lib
from april_jax.config import ConfigError
from april_jax.models import hf, lora, qwen3
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig, Trainer, token_logprobs
from april_jax.training.metrics import read_metrics
from tiny_models import TINY_QWEN3

ROOT = Path(__file__).resolve().parents[1]


def batch(B=4, S=10, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S - 1), np.float32)
    mask[:, 3:] = 1
    return {
        "input_ids": rng.integers(0, vocab, (B, S)).astype(np.int32),
        "loss_mask": mask,
        "behaviour_logp": np.full((B, S - 1), -4.0, np.float32),
        "versions": np.zeros((B, S - 1), np.int32),
        "advantages": rng.normal(size=B).astype(np.float32),
    }


def with_random_b(trainer: Trainer, seed=1, size=0.05):
    """Adapters whose B is nonzero (as after training), so that they change the model."""
    leaves, treedef = jax.tree.flatten_with_path(trainer.params)
    rng = np.random.default_rng(seed)
    new = [
        jnp.asarray(rng.normal(size=x.shape) * size, jnp.float32) if "lora_b" in str(path) else x for path, x in leaves
    ]
    trainer.params = jax.tree.unflatten(treedef, new)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_fresh_adapters_are_the_base_and_only_they_train():
    base = qwen3.init_model(TINY_QWEN3, seed=3)
    ids = batch()["input_ids"]
    want = np.asarray(base(jnp.asarray(ids)))
    trainer = Trainer(base, LossConfig(), OptimizerConfig(lr=1e-2), lora=lora.LoRAConfig(4, 8.0, ("q", "v", "down")))
    np.testing.assert_array_equal(np.asarray(trainer._policy(trainer.params, trainer.base)(jnp.asarray(ids))), want)
    np.testing.assert_array_equal(np.asarray(trainer.model()(jnp.asarray(ids))), want)  # merged, B = 0
    assert base.layers[0].self_attn.q_proj.lora_a is None, "the caller's model gets no adapters"

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(trainer.params)[0]]
    assert len(paths) == 2 * 3 * TINY_QWEN3.num_hidden_layers and all("lora_" in p for p in paths)
    _, grads = trainer.loss_and_grads(batch(), 0)
    assert jax.tree.structure(grads) == jax.tree.structure(trainer.params)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads)), "B gets a gradient at B = 0"
    # AdamW's two moments per adapter parameter, and a step count: nothing of the base
    adapter_bytes = nbytes(trainer.params)
    assert adapter_bytes < nbytes(trainer.base) / 4
    assert 2 * adapter_bytes <= nbytes(trainer.opt_state) <= 2 * adapter_bytes + 64
    before = jax.tree.map(np.asarray, trainer.base)
    trainer.step(batch(), 0)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.base))  # frozen
    assert float(jnp.abs(trainer.params["layers"][0]["mlp"]["down_proj"]["lora_b"]).max()) > 0


def test_kl_reference_is_the_base_with_adapters_off_and_merge_matches():
    base = qwen3.init_model(TINY_QWEN3, seed=4)
    b = batch()
    # the same program as the reference's (eager logprobs differ in the last bits)
    base_logp = np.asarray(Trainer(base, LossConfig(), OptimizerConfig()).logprobs(b["input_ids"]))
    trainer = Trainer(base, LossConfig(kl_coef=0.1), OptimizerConfig(), lora=lora.LoRAConfig(4))
    assert trainer.ref_params is None, "no copy of the base"
    with_random_b(trainer)
    prepared = trainer.prepare(b)
    np.testing.assert_array_equal(np.asarray(prepared["ref_logp"]), base_logp)
    policy_logp = np.asarray(prepared["old_logp"])
    assert np.abs(policy_logp - base_logp).max() > 1e-3, "the adapters change the policy"
    merged_logp = np.asarray(token_logprobs(trainer.model(), jnp.asarray(b["input_ids"]))[0])
    np.testing.assert_allclose(merged_logp, policy_logp, atol=1e-5)
    metrics, _ = trainer.loss_and_grads(b, 0)
    assert float(metrics["train/kl"]) > 0


def test_peft_loads_the_adapters_with_our_logits(tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    from safetensors.numpy import save_file

    from hf_utils import hf_logits, save_tiny

    hf_model = save_tiny(tmp_path / "base")
    model = hf.from_pretrained(tmp_path / "base")
    cfg = lora.LoRAConfig(4, 16.0, ("q", "k", "o", "up", "down"))
    trainer = Trainer(model, LossConfig(), OptimizerConfig(), lora=cfg)
    with_random_b(trainer, size=0.2)
    ids = np.random.default_rng(0).integers(0, 160, (2, 12))
    ours = np.asarray(trainer._policy(trainer.params, trainer.base)(jnp.asarray(ids)))

    out = tmp_path / "adapter"
    out.mkdir()
    save_file(lora.peft_tensors(trainer.params), str(out / "adapter_model.safetensors"))
    keys = {"lora_rank": 4, "lora_alpha": 16.0, "lora_targets": "q,k,o,up,down"}
    (out / "adapter_config.json").write_text(json.dumps(lora.peft_config(keys, str(tmp_path / "base"))))
    peft_model = peft.PeftModel.from_pretrained(hf_model, str(out)).eval()
    theirs = hf_logits(peft_model, ids)
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    with torch.no_grad(), peft_model.disable_adapter():
        np.testing.assert_allclose(hf_logits(peft_model, ids), np.asarray(model(jnp.asarray(ids))), atol=1e-4)


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"lora_rank": -1}, "model.lora_rank"),
        ({"lora_rank": 0, "lora_targets": "q,v"}, "needs model.lora_rank > 0"),
        ({"lora_rank": 4, "lora_targets": "q,attn"}, "allowed: all or q,k,v,o,gate,up,down"),
        ({"lora_rank": 4, "lora_alpha": 0.0}, "model.lora_alpha"),
    ],
)
def test_bad_lora_keys_are_config_errors(overrides, words):
    c = config_lib.default_config()
    c.model.arch = "tiny"
    for k, v in overrides.items():
        c.model[k] = v
    with pytest.raises(ConfigError, match=re.escape(words)):
        config_lib.validate(c)


def test_a_rank_above_a_targets_width_names_it():
    cfg = TINY_QWEN3.replace(num_key_value_heads=1)  # k_proj and v_proj: 32 -> 8
    with pytest.raises(ValueError, match="exceeds target 'k'.*rank at most 8"):
        lora.check_rank(cfg, lora.LoRAConfig(12, targets=("q", "k")))
    lora.check_rank(cfg, lora.LoRAConfig(12, targets=("q", "o", "up")))


# ---------------- through the CLI ----------------

STEPS = 4
ARGS = [
    "--config",
    str(ROOT / "configs/tiny.py"),
    "--config.warmup.steps=20",
    "--config.rollout.rollout_batch_size=2",
    "--config.rollout.over_sampling_batch_size=4",
    "--config.rollout.n_samples_per_prompt=2",
    "--config.rollout.max_num_seqs=8",
    "--config.train.micro_batch_size=4",
    "--config.eval.every=0",
    "--config.log.progress=false",
    "--config.log.tensorboard=false",
    f"--config.train.total_steps={STEPS}",
    "--config.checkpoint.every=2",
    "--config.model.lora_rank=4",
    "--config.optimizer.lr=1e-3",
    "--config.loss.kl_coef=0.01",
]


def run(*args, workdir=None):
    import os

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, *args] + ([f"--config.workdir={workdir}"] if workdir is not None else [])
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_lora_run_resumes_identically_and_exports(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    from hf_utils import hf_logits

    full = tmp_path / "full"
    proc = run("-m", "april_jax.train", *ARGS, workdir=full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(full)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(np.isfinite(r["train/loss"]) for r in rows) and any(r["train/grad_norm"] > 0 for r in rows)
    meta = json.loads((full / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["files"]

    # resumed from step 2's checkpoint (a copy of the run as it was then): the same steps 2 and 3
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "lora_base", resumed / "lora_base")
    shutil.copytree(full / "checkpoints" / "2", resumed / "checkpoints" / "2")
    for name in ("metrics.jsonl", "delivered.jsonl"):
        lines = (full / name).read_text().splitlines(keepends=True)
        (resumed / name).write_text("".join(line for line in lines if json.loads(line)["step"] < 2))
    proc = run("-m", "april_jax.train", *ARGS, workdir=resumed)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
    strip = lambda r: {k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("_s"))}
    assert [strip(r) for r in read_metrics(resumed)] == [strip(r) for r in rows]

    # another rank, or another base: one error line each
    proc = run("-m", "april_jax.train", *ARGS, "--config.model.lora_rank=2", workdir=resumed)
    assert proc.returncode != 0 and "model.lora_rank: 4 -> 2" in proc.stderr.strip().splitlines()[-1], proc.stderr
    safetensors = next((resumed / "lora_base").glob("*.safetensors"))
    data = bytearray(safetensors.read_bytes())
    data[-4:] = b"\0\0\0\1"
    safetensors.write_bytes(bytes(data))
    proc = run("-m", "april_jax.train", *ARGS, workdir=resumed)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error:") and "LoRA base" in last, proc.stderr[-2000:]

    # inspect, export-hf (merged) and export-peft: PEFT on the base gives the merged model's logits
    proc = run("-m", "april_jax.cli.ckpt", "inspect", str(full))
    assert proc.returncode == 0 and "LoRA: rank 4" in proc.stdout, proc.stderr
    for cmd in ("export-hf", "export-peft"):
        proc = run("-m", "april_jax.cli.ckpt", cmd, str(full), str(tmp_path / cmd))
        assert proc.returncode == 0, proc.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export-hf", dtype="float32").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(full / "lora_base", dtype="float32").eval()
    with_adapters = peft.PeftModel.from_pretrained(base, str(tmp_path / "export-peft")).eval()
    ids = np.random.default_rng(0).integers(0, merged.config.vocab_size, (2, 9))
    np.testing.assert_allclose(hf_logits(with_adapters, ids), hf_logits(merged, ids), atol=1e-4)
    plain = transformers.AutoModelForCausalLM.from_pretrained(full / "lora_base", dtype="float32").eval()
    assert np.abs(hf_logits(merged, ids) - hf_logits(plain, ids)).max() > 1e-4, "the adapters trained"

    # a full fine-tuning run has no adapters to export
    meta_ft = dict(meta, config=dict(meta["config"], model=dict(meta["config"]["model"], lora_rank=0)))
    ft = tmp_path / "ft" / "checkpoints" / "4" / "meta"
    ft.mkdir(parents=True)
    (ft / "metadata").write_text(json.dumps(meta_ft))
    proc = run("-m", "april_jax.cli.ckpt", "export-peft", str(tmp_path / "ft"), str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "full fine-tuning" in proc.stderr


# ---------------- resume checks and the engine's weights, without a run ----------------


def fake_checkpoint(workdir: Path, model_keys: dict) -> Path:
    """WORKDIR/checkpoints/2 with only its meta: what `check_resumable` reads."""
    meta_dir = workdir / "checkpoints" / "2" / "meta"
    meta_dir.mkdir(parents=True)
    config = {"model": dict(model_keys), "rollout": {"n_samples_per_prompt": 2}, "data": {"task": "arith"}}
    meta = {"step": 2, "version": 2, "skipped_steps": 0, "data": {}, "april": {}, "model_config": {}}
    (meta_dir / "metadata").write_text(json.dumps(dict(meta, config=config)))
    return workdir / "checkpoints"


def test_resume_refuses_another_lora_alpha_and_reads_targets_however_written(tmp_path):
    from april_jax.runtime.checkpoints import Checkpointer
    from april_jax.runtime.errors import CheckpointError

    recorded = {"lora_rank": 4, "lora_alpha": 32.0, "lora_targets": "q,k,v,o,gate,up,down"}
    ckpt = Checkpointer(fake_checkpoint(tmp_path, recorded), async_save=False)
    config = lambda **model: {  # noqa: E731
        "model": dict(recorded, **model),
        "rollout": {"n_samples_per_prompt": 2},
        "data": {"task": "arith"},
    }
    ckpt.check_resumable(config(lora_targets="all"), {})  # the same seven projections
    ckpt.check_resumable(config(lora_targets="v, q,k,o,up,down,gate", lora_alpha=32), {})
    with pytest.raises(CheckpointError, match=re.escape("model.lora_alpha: 32.0 -> 16.0")) as e:
        ckpt.check_resumable(config(lora_alpha=16.0), {})
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=re.escape("model.lora_targets: 'q,k,v,o,gate,up,down' -> 'q,v'")):
        ckpt.check_resumable(config(lora_targets="q,v"), {})
    ckpt.close()

    # full fine-tuning: lora_alpha means nothing, a changed one is no reason to refuse
    full = {"lora_rank": 0, "lora_alpha": 32.0, "lora_targets": "all"}
    ckpt = Checkpointer(fake_checkpoint(tmp_path / "ft", full), async_save=False)
    ckpt.check_resumable({**config(), "model": dict(full, lora_alpha=8.0)}, {})
    ckpt.close()


def test_the_engine_on_its_own_mesh_gets_the_merged_weights():
    from flax import nnx

    from april_jax.models.sharding import make_mesh
    from april_jax.runtime import distributed

    trainer = Trainer(qwen3.init_model(TINY_QWEN3, seed=5), LossConfig(), OptimizerConfig(), lora=lora.LoRAConfig(4))
    with_random_b(trainer)
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=jax.devices()[:1])
    model = distributed.engine_model(trainer, mesh)  # the multi-process path: gathered, placed on `mesh`
    assert model.layers[0].self_attn.q_proj.lora_a is None, "a plain model: the engine's programs"
    ids = jnp.asarray(batch()["input_ids"])
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(trainer.model()(ids)), atol=1e-5)
    state = distributed.engine_state(trainer, mesh)
    want = nnx.to_pure_dict(trainer.nnx_state())
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(state), jax.tree.map(np.asarray, want))


def test_smollm2_lora_config_is_smollm2_rl_with_adapters():
    from april_jax.config.loading import load_config
    from april_jax.config.schema import flat

    lora_c = load_config(["x", "--config", str(ROOT / "configs/smollm2_lora.py")])
    rl_c = load_config(["x", "--config", str(ROOT / "configs/smollm2_rl.py")])
    differ = {k for k, v in flat(lora_c).items() if flat(rl_c).get(k) != v}
    assert differ == {"workdir", "model.lora_rank", "optimizer.lr"}, differ  # lora_alpha 32: the default
    assert (lora_c.model.lora_rank, lora_c.model.lora_alpha, lora_c.model.lora_targets) == (16, 32.0, "all")
    assert lora_c.optimizer.lr == 10 * rl_c.optimizer.lr
