"""Generation demo on real weights: SmolLM2-135M-Instruct answers questions on CPU, through the
same embedded engine that generates training rollouts (continuous batching, KV cache, stop ids).

    python -m april_jax.cli.demo ["your question" ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from april_jax import assets
from april_jax.cli import prog
from april_jax.data.tokenizer import ChatTokenizer
from april_jax.models import hf
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog("april_jax.cli.demo"),
        description="SmolLM2-135M-Instruct answers each question greedily on the embedded JAX engine.",
    )
    parser.add_argument("questions", nargs="*", help="questions to answer (default: two examples)")
    questions = parser.parse_args(sys.argv[1:] if argv is None else argv).questions or [
        "What is the capital of France?",
        "What is 12 + 30?",
    ]
    path = assets.smollm2_135m_instruct()
    t = time.perf_counter()
    model = hf.from_pretrained(path)
    print(f"loaded {path} ({model.cfg.num_params / 1e6:.0f}M params) in {time.perf_counter() - t:.1f}s")
    tok = ChatTokenizer(path)
    prompts = [tok.encode_prompt(q) for q in questions]
    max_new_tokens = 48
    engine = JaxEngine(model, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + max_new_tokens)
    t = time.perf_counter()
    out = engine.generate(
        [
            Request(str(i), p, max_new_tokens, SamplingParams(temperature=0.0), tok.stop_ids)
            for i, p in enumerate(prompts)
        ]
    )
    answers = [out[str(i)].token_ids for i in range(len(prompts))]
    print(f"generated {sum(map(len, answers))} tokens in {time.perf_counter() - t:.1f}s (incl. compile)")
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {tok.decode(a)}\n")


if __name__ == "__main__":
    main()
