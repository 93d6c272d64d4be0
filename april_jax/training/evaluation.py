"""Held-out evaluation: k samples per eval prompt on the rollout engine, scored by the task's reward."""

from __future__ import annotations

import numpy as np


def evaluate(engine, prompts, scorer, c, stop_ids, version: int) -> dict:
    """avg@k: mean reward over k samples per held-out prompt; pass@1-style accuracy = reward == 1."""
    from april_jax.rollout.types import Request, SamplingParams

    if not prompts:
        return {}
    reqs = [
        Request(
            f"eval/{i}/{k}",
            p.prompt_ids,
            c.rollout.max_response_len,
            SamplingParams(c.eval.temperature, seed=1000 * i + k),
            stop_ids,
        )
        for i, p in enumerate(prompts)
        for k in range(c.eval.n_samples)
    ]
    out = engine.generate(reqs)
    samples = [
        scorer.sample(
            prompts[int(r.request_id.split("/")[1])],
            out[r.request_id].token_ids,
            out[r.request_id].finish_reason,
            int(r.request_id.split("/")[2]),
        )
        for r in reqs
    ]
    scores = np.array(scorer.model.score_many(samples))
    return {
        f"eval/avg@{c.eval.n_samples}": float(scores.mean()),
        "eval/accuracy": float(np.mean(scores >= 1.0)),
        "eval/response_len": float(np.mean([len(out[r.request_id].token_ids) for r in reqs])),
        "eval/version": version,
    }
