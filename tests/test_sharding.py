"""Mesh construction and sharded loading on 8 fake CPU devices (see conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from april_jax.models import hf, qwen3, sharding
from hf_utils import hf_logits
from tiny_models import TINY_QWEN3

IDS = np.random.RandomState(1).randint(0, 160, size=(4, 12))


def test_make_mesh_fills_minus_one():
    assert jax.device_count() == 8
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    one = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize(
    "axes,match",
    [
        ({"data": 3, "fsdp": -1}, "not divisible"),
        ({"data": -1, "fsdp": -1}, "at most one"),
        ({"model": 2}, "unknown axis"),
        ({"data": 4, "fsdp": 4}, "need 16 devices"),
    ],
)
def test_make_mesh_bad_axes(axes, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(axes)


def test_logical_rules_replicate_indivisible_dims():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.logical_to_spec(("mlp", "embed"), (96, 64), mesh) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("vocab", "embed"), (151, 64), mesh) == P(None, "fsdp")
    assert sharding.logical_to_spec(("norm",), (64,), mesh) == P(None)


def test_sharded_forward_equals_single_device(tiny_hf_checkpoint):
    path, ref = tiny_hf_checkpoint
    single = hf.from_pretrained(path)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = hf.from_pretrained(path, mesh=mesh)

    w = sharded.layers[0].mlp.gate_proj.weight[...]
    assert w.sharding.spec == P("tensor", "fsdp")
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (48, 32)
    assert sharded.layers[0].self_attn.q_proj.weight[...].sharding.spec == P("tensor", "fsdp")

    ids = jax.device_put(jnp.asarray(IDS, jnp.int32), sharding.batch_sharding(mesh))
    out_sharded = np.asarray(jax.jit(lambda m, x: m(x))(sharded, ids))
    out_single = np.asarray(single(jnp.asarray(IDS, jnp.int32)))
    np.testing.assert_allclose(out_sharded, out_single, atol=2e-5)
    assert np.abs(out_single - hf_logits(ref, IDS)).max() <= 1e-4


def test_init_model_on_mesh_is_sharded():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    model = qwen3.init_model(TINY_QWEN3, seed=0, mesh=mesh)
    assert model.embed_tokens[...].sharding.spec == P("tensor", "fsdp")
    reference = qwen3.init_model(TINY_QWEN3, seed=0)
    ids = jnp.asarray(IDS % TINY_QWEN3.vocab_size, jnp.int32)
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(reference(ids)), atol=2e-5)
