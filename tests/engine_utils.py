"""What the JAX-engine tests share besides the tiny checkpoint (fixture `tiny_reference`):
transformers' greedy continuation to compare against."""

from __future__ import annotations

import torch

from april_jax.rollout.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def transformers_greedy(ref, prompt, new_tokens: int) -> list[int]:
    """Exactly `new_tokens` greedy tokens after `prompt` from transformers `generate` (no early stop)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()
