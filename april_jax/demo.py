"""Generation demo on real weights: SmolLM2-135M-Instruct answers questions on CPU.

    python -m april_jax.demo ["your question" ...]
"""

from __future__ import annotations

import sys
import time

from april_jax import assets
from april_jax.models import qwen3
from april_jax.models.generate import generate


def main(argv: list[str]) -> None:
    from tokenizers import Tokenizer

    questions = argv or ["What is the capital of France?", "What is 12 + 30?"]
    path = assets.smollm2_135m_instruct()
    t = time.perf_counter()
    model = qwen3.from_pretrained(path)
    print(f"loaded {path} ({model.cfg.num_params / 1e6:.0f}M params) in {time.perf_counter() - t:.1f}s")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids for q in questions]
    t = time.perf_counter()
    answers = generate(model, prompts, max_new_tokens=48, stop_ids=[end])
    print(f"generated {sum(map(len, answers))} tokens in {time.perf_counter() - t:.1f}s (incl. compile)")
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {tok.decode(a, skip_special_tokens=True)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
