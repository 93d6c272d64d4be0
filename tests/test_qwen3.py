"""Qwen3 model: logits against transformers, HF save/load round trips, KV cache, presets, errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from april_jax.models import hf, qwen3
from april_jax.models.qwen3 import KVCache, Qwen3Config
from april_jax.models.safetensors_io import CheckpointError
from hf_utils import hf_logits, save_tiny, tiny_hf_model

IDS = np.random.RandomState(0).randint(0, 160, size=(3, 13))

CONFIGS = {
    "untied_gqa2": dict(),
    "tied": dict(tie_word_embeddings=True),
    "mha_gqa1": dict(num_key_value_heads=4),
    "gqa4_3layers": dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "head_dim_not_hidden_over_heads": dict(head_dim=24, num_attention_heads=4, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_qwen3(tmp_path, name):
    ref = save_tiny(tmp_path, "qwen3", **CONFIGS[name])
    model = hf.from_pretrained(tmp_path)
    assert model.cfg.qk_norm and model.cfg.tie_word_embeddings == CONFIGS[name].get("tie_word_embeddings", False)
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    assert ours.dtype == np.float32 and ours.shape == (3, 13, 160)
    assert np.abs(ours - hf_logits(ref, IDS)).max() <= 1e-4


@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("llama", {"attention_bias": True}), ("llama", {})])
def test_logits_match_transformers_other_families(tmp_path, model_type, extra):
    kw = dict(extra)
    kw.pop("head_dim", None)
    ref = save_tiny(tmp_path, model_type, **kw)
    model = hf.from_pretrained(tmp_path)
    assert not model.cfg.qk_norm
    assert np.abs(np.asarray(model(jnp.asarray(IDS, jnp.int32))) - hf_logits(ref, IDS)).max() <= 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_loads_in_transformers(tmp_path, tied):
    save_tiny(tmp_path / "src", tie_word_embeddings=tied)
    model = hf.from_pretrained(tmp_path / "src")
    hf.save_pretrained(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings == tied
    ours = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    assert np.abs(hf_logits(reloaded, IDS) - ours).max() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    ref = tiny_hf_model(num_hidden_layers=3)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 2
    model = hf.from_pretrained(tmp_path / "hf")
    assert np.abs(np.asarray(model(jnp.asarray(IDS, jnp.int32))) - hf_logits(ref, IDS)).max() <= 1e-4
    # Our own sharded writer: several files + index, read back by transformers and by us.
    hf.save_pretrained(model, tmp_path / "ours", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert np.abs(hf_logits(again, IDS) - hf_logits(ref, IDS)).max() <= 1e-5


def test_bf16_params(tmp_path):
    ref = save_tiny(tmp_path)
    model = hf.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert model.layers[0].mlp.up_proj.weight[...].dtype == jnp.bfloat16
    logits = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    assert logits.dtype == np.float32
    assert np.abs(logits - hf_logits(ref, IDS)).max() < 0.1  # bf16 rounding only


def test_kv_cache_prefill_then_decode_equals_full_forward(tmp_path):
    save_tiny(tmp_path, num_attention_heads=8, num_key_value_heads=2)
    model = hf.from_pretrained(tmp_path)
    full = np.asarray(model(jnp.asarray(IDS, jnp.int32)))
    # Rows prefill different lengths (right-padded), then decode one token at a time.
    prefill_lengths = np.array([5, 1, 9], np.int32)
    padded = np.where(np.arange(9)[None] < prefill_lengths[:, None], IDS[:, :9], 0)
    cache = KVCache.zeros(model.cfg, batch=3, max_len=16)
    logits, cache = model.forward(jnp.asarray(padded, jnp.int32), cache=cache, num_new_B=jnp.asarray(prefill_lengths))
    for row, n in enumerate(prefill_lengths):
        np.testing.assert_allclose(np.asarray(logits)[row, :n], full[row, :n], atol=1e-4)
    assert cache.lengths_B.tolist() == prefill_lengths.tolist()
    positions = prefill_lengths.copy()
    for _ in range(13 - 9):
        step_ids = IDS[np.arange(3), positions][:, None]
        logits, cache = model.forward(jnp.asarray(step_ids, jnp.int32), cache=cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[np.arange(3), positions], atol=1e-4)
        positions += 1


def test_presets_match_official_configs():
    expected = {  # Qwen/Qwen3-*/config.json
        "qwen3-0.6b": (1024, 28, 16, 8, 3072, True),
        "qwen3-1.7b": (2048, 28, 16, 8, 6144, True),
        "qwen3-4b": (2560, 36, 32, 8, 9728, True),
        "qwen3-8b": (4096, 36, 32, 8, 12288, False),
    }
    for name, (hidden, layers, heads, kv, inter, tie) in expected.items():
        c = qwen3.PRESETS[name]
        assert (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.intermediate_size,
            c.tie_word_embeddings,
        ) == (hidden, layers, heads, kv, inter, tie)
        assert (c.head_dim, c.vocab_size, c.rope_theta) == (128, 151936, 1e6)
    assert 7.5e9 < qwen3.PRESETS["qwen3-8b"].num_params < 8.5e9
    assert 3.8e9 < qwen3.PRESETS["qwen3-4b"].num_params < 4.2e9


def test_hf_config_round_trip():
    cfg = qwen3.PRESETS["qwen3-4b"]
    assert Qwen3Config.from_hf_config(cfg.to_hf_config()) == cfg
    hf = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_config().items() if k != "rope_scaling"})
    assert Qwen3Config.from_hf_config(hf.to_dict()) == cfg


# ---- bad input: one clear error naming the culprit ----


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        hf.from_pretrained(tmp_path)


def test_unknown_model_type(tmp_path):
    save_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model_type 'mixtral'"):
        hf.from_pretrained(tmp_path)


def test_missing_tensor_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        hf.from_pretrained(tmp_path)


def test_wrong_shape_named(tmp_path):
    save_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 96\), expected \(64, 128\)"
    ):
        hf.from_pretrained(tmp_path)


def test_missing_weights_file(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        hf.from_pretrained(tmp_path)


@pytest.mark.parametrize("T", [200, 512])
def test_long_sequence_block_causal_attention_matches_transformers(tmp_path, T):
    """At T >= 128 the cache-free forward skips masked query blocks (uneven blocks at T=200)."""
    ref = save_tiny(tmp_path, "qwen3", num_attention_heads=8, num_key_value_heads=2)
    model = hf.from_pretrained(tmp_path)
    ids = np.random.RandomState(1).randint(0, 160, size=(2, T))
    assert min(qwen3.CAUSAL_BLOCKS_MAX, T // qwen3.CAUSAL_BLOCK_MIN) > 1
    blocked = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    dense = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.broadcast_to(jnp.arange(T), (2, T))))
    assert np.abs(blocked - hf_logits(ref, ids)).max() <= 1e-4
    assert np.abs(blocked - dense).max() <= 1e-5


@pytest.mark.slow  # two compiles of a 4-layer forward and backward: ~15-25 s each on 2 cores
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_keeps_loss_and_gradients(policy):
    cfg = Qwen3Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 160, (2, 140)), jnp.int32)

    def loss_and_grads(model):
        loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids))[..., 7])
        return loss(model), jax.tree.leaves(nnx.state(nnx.grad(loss)(model)))

    plain_loss, plain = loss_and_grads(qwen3.init_model(cfg))
    model = qwen3.init_model(cfg.replace(remat=policy))
    remat_loss, remat = loss_and_grads(model)
    jaxpr = str(
        jax.make_jaxpr(lambda s: nnx.grad(lambda m: jnp.sum(m(ids)))(nnx.merge(nnx.graphdef(model), s)))(
            nnx.state(model)
        )
    )
    assert "remat" in jaxpr  # the layers really are rematerialised
    assert abs(float(plain_loss) - float(remat_loss)) <= 1e-6
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(plain, remat)) <= 1e-6
    with pytest.raises(ValueError, match="remat='sometimes'"):
        cfg.replace(remat="sometimes")


def test_flash_attention_call_has_our_layout_and_gqa_grouping():
    """The cuDNN path (GPU only) is jax.nn.dot_product_attention; its XLA implementation must give
    what our attention gives, so the layout and the grouping of query heads onto KV heads agree."""
    B, T, H, K, D = 2, 50, 8, 2, 16
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, n, D)), jnp.float32) for n in (H, K, K))
    flash_BTHD = qwen3._flash_causal_attention(q, k, v, jnp.float32, "xla")
    causal_BTS = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    ours_BKGTD = qwen3._dense_attention(
        jnp.transpose(q.reshape(B, T, K, H // K, D), (0, 2, 3, 1, 4)),
        jnp.transpose(k, (0, 2, 3, 1)),
        jnp.transpose(v, (0, 2, 1, 3)),
        causal_BTS,
        jnp.float32,
    )
    ours_BTHD = jnp.transpose(ours_BKGTD, (0, 3, 1, 2, 4)).reshape(B, T, H, D)
    assert float(jnp.abs(flash_BTHD - ours_BTHD).max()) <= 1e-5
    assert not qwen3._use_cudnn(
        Qwen3Config(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=8,
        )
    )  # CPU: auto -> xla
