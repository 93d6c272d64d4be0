"""Weight transport: HF-named tensors from JAX params (DLPack zero-copy) and the safetensors transport."""

import jax
import numpy as np
import torch
import transformers

from april_jax.models import hf, qwen3, sharding
from april_jax.rollout.vllm import weights
from tiny_models import TINY_QWEN3


def test_named_torch_is_zero_copy_and_hf_named():
    model = qwen3.init_model(TINY_QWEN3, seed=0)
    named = weights.named_torch(model)
    assert "model.layers.1.mlp.down_proj.weight" in named and "lm_head.weight" in named
    jax_array = model.layers[1].mlp.down_proj.weight[...]
    t = named["model.layers.1.mlp.down_proj.weight"]
    assert t.data_ptr() == jax_array.unsafe_buffer_pointer(), "DLPack must not copy"
    np.testing.assert_array_equal(t.numpy(), np.asarray(jax_array))


def test_sharded_params_are_gathered():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    model = qwen3.init_model(TINY_QWEN3, seed=1, mesh=mesh)
    reference = qwen3.init_model(TINY_QWEN3, seed=1)
    named = weights.named_numpy(model)
    np.testing.assert_array_equal(
        named["model.layers.0.mlp.up_proj.weight"], np.asarray(reference.layers[0].mlp.up_proj.weight[...])
    )


def test_safetensors_transport_loads_into_transformers(tmp_path):
    model = qwen3.init_model(TINY_QWEN3, seed=2)
    hf.save_pretrained(model, tmp_path)  # config + weights of seed 2
    changed = qwen3.init_model(TINY_QWEN3, seed=3)
    weights.write_safetensors(weights.named_torch(changed), tmp_path / "model.safetensors")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = np.array([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(changed(jax.numpy.asarray(ids, jax.numpy.int32))) - ref).max() < 1e-4


def test_shared_buffer_overwrites_in_place_and_reads_back(tmp_path):
    import safetensors.torch

    a, b = qwen3.init_model(TINY_QWEN3, seed=4), qwen3.init_model(TINY_QWEN3, seed=5)
    buffer = weights.SharedSafetensors(weights.named_torch(a), tmp_path / "shared.safetensors")
    for model in (a, b):
        buffer.write(weights.named_torch(model))
        loaded = safetensors.torch.load_file(buffer.path)
        expected = weights.named_numpy(model)
        assert loaded.keys() == expected.keys()
        assert all(np.array_equal(loaded[k].numpy(), v) for k, v in expected.items())
    size = (tmp_path / "shared.safetensors").stat().st_size
    buffer.write(weights.named_torch(a))
    assert (tmp_path / "shared.safetensors").stat().st_size == size


def test_bf16_params_go_through_both_host_transports(tmp_path):
    """torch's `.numpy()` refuses bf16: the file and shm transports must still carry bf16 params."""
    import safetensors.torch

    model = qwen3.init_model(TINY_QWEN3.replace(param_dtype=jax.numpy.bfloat16), seed=6)
    named = weights.named_torch(model)
    assert named["model.norm.weight"].dtype == torch.bfloat16
    weights.write_safetensors(named, tmp_path / "file.safetensors")
    buffer = weights.SharedSafetensors(named, tmp_path / "shared.safetensors")
    buffer.write(named)
    for path in (tmp_path / "file.safetensors", buffer.path):
        loaded = safetensors.torch.load_file(path)
        assert loaded.keys() == named.keys()
        assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], v) for k, v in named.items())
