"""Reward functions: math-verify in worker processes, the tiny task's, or any `module:function`.

math-verify times out with `signal.alarm`, which only works in a process's main thread, so it
runs in a process pool; a timeout or an exception gives reward 0 and is counted (`reward/failures`).
A custom function is called as `fn(response_text, answer) -> float` in the trainer process.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing
import re
from typing import Callable

from april_jax.data import reverse

BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    starts = [m.end() for m in BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the last boxed answer (or, failing that, the text) equals `answer` per math-verify."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    candidate = parse("\\boxed{" + boxed + "}" if boxed is not None else response)
    gold = parse("\\boxed{" + answer + "}")
    return 1.0 if candidate and gold and verify(gold, candidate) else 0.0


def load_function(spec: str) -> Callable[[str, str], float]:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"reward.fn={spec!r}: expected 'module.path:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.fn={spec!r}: cannot import ({e})") from None


class RewardModel:
    """Scores (response text or ids, answer) pairs; failures score 0 and are counted."""

    def __init__(self, spec: str, *, decode=None, timeout_s: float = 5.0, workers: int = 2):
        self.spec, self.decode, self.timeout_s = spec, decode, timeout_s
        self.failures = 0
        self._pool = None
        if spec == "math_verify":
            self._fn = math_verify_reward
            self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        elif spec == "reverse":
            self._fn = None
        else:
            self._fn = load_function(spec)

    def score(self, response_ids, answer: str) -> float:
        if self.spec == "reverse":
            return reverse.reward(response_ids, answer)
        text = self.decode(response_ids) if self.decode else response_ids
        try:
            if self._pool is not None:
                return float(self._pool.submit(self._fn, text, answer).result(timeout=self.timeout_s))
            return float(self._fn(text, answer))
        except Exception:  # a judge failure must not stop training; it is counted
            self.failures += 1
            return 0.0

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
