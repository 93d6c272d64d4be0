"""Tiny random Hugging Face checkpoints built with `transformers`, the independent reference."""

from __future__ import annotations

import numpy as np
import torch
import transformers


def tiny_hf_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    """A random transformers causal LM (fp32, eval mode)."""
    kw = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    kw.update(overrides)
    config_cls = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
    }[model_type]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kw), dtype=torch.float32).eval()
    # Non-trivial norm weights and biases, so a mapping mistake shows up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tiny(path, model_type: str = "qwen3", seed: int = 0, **overrides):
    model = tiny_hf_model(model_type, seed, **overrides)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()
