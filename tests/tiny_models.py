"""The tiny models most tests run on: one Qwen3 shape built in JAX, and one random transformers
checkpoint (the independent reference) that several modules load (fixtures `tiny_hf_checkpoint` and
`tiny_reference` in conftest.py, saved once per session)."""

from __future__ import annotations

from april_jax.models import hf
from april_jax.models.qwen3 import Qwen3Config
from hf_utils import save_tiny

# Two layers, grouped-query attention (4 heads over 2 KV heads), untied embeddings: every code
# path of the real models at a size that compiles in seconds. Init with qwen3.init_model(TINY_QWEN3, seed).
TINY_QWEN3 = Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def save_tiny_hf_checkpoint(path):
    """(path, transformers model) of hf_utils' default tiny Qwen3 (vocab 160, 2 layers, 4 heads over
    2 KV heads, seed 0), saved as a Hugging Face checkpoint."""
    return path, save_tiny(path)


def load_reference_and_model(checkpoint):
    """(transformers model, our model loaded from the same checkpoint)."""
    path, reference = checkpoint
    return reference, hf.from_pretrained(path)
