"""Milliseconds per JaxEngine decode call of the tiny model at several busy-row counts (JSON).

    python -m benchmarks.probes.tiny_decode_calls [--steps-per-call 2] [--full]

The tiny config's model shape (configs/tiny.py: 2 layers, width 64, vocabulary 16), random
weights, 128 slots, max_model_len 48, sampled at temperature 0.7: for each row count, 6 rounds of
that many 6-token prompts run to 40 tokens; the median over every `engine.step()` after a round's
first (which prefills). `--full` runs the uncompacted reference path (`compact_decode=False`).
"""

import argparse
import json
import statistics
import time

from april_jax.models import qwen3
from april_jax.rollout.jax_engine import JaxEngine
from april_jax.rollout.types import Request, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-per-call", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    cfg = qwen3.Qwen3Config(
        vocab_size=16,
        max_position_embeddings=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e4,
    )
    model = qwen3.init_model(cfg, seed=0)
    out = {}
    for rows in map(int, args.rows.split(",")):
        engine = JaxEngine(
            model,
            max_num_seqs=128,
            max_model_len=48,
            decode_steps_per_call=args.steps_per_call,
            samples_per_prompt=8,
            compact_decode=not args.full,
        )
        times = []
        for round_ in range(args.rounds):
            engine.submit(
                [Request(f"{round_}-{i}", (1, 3, 5, 6, 7, 4), 40, SamplingParams(temperature=0.7)) for i in range(rows)]
            )
            engine.step()
            while engine.has_unfinished():
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
        out[rows] = round(statistics.median(times) * 1e3, 3)
    print(
        json.dumps(
            {"steps_per_call": args.steps_per_call, "compact_decode": not args.full, "ms_per_call_by_busy_rows": out}
        )
    )


if __name__ == "__main__":
    main()
