"""Setup the JAX-engine tests share: the tiny checkpoint (transformers reference + our model loaded
from it) and transformers' greedy continuation to compare against."""

from __future__ import annotations

import torch

from april_jax.models import hf
from april_jax.rollout.types import SamplingParams
from hf_utils import save_tiny

GREEDY = SamplingParams(temperature=0.0)


def tiny_reference_and_model(path, **overrides):
    """(transformers model, our model loaded from its checkpoint): a 2-layer Qwen3 of vocab 160."""
    kw = dict(vocab_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **overrides)
    ref = save_tiny(path, **kw)
    return ref, hf.from_pretrained(path)


def transformers_greedy(ref, prompt, new_tokens: int) -> list[int]:
    """Exactly `new_tokens` greedy tokens after `prompt` from transformers `generate` (no early stop)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()
