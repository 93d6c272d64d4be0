"""The synthetic tiny task: reverse a list of digits. Verifiable, with long-tailed answer lengths.

Prompt `<bos> R d1 d2 ... dn =`, answer `dn ... d1 <eos>`. List lengths follow the shape of the
seed's distribution (60% short, 25% medium, 15% long): 2-5, 6-10, 11-20 digits, so responses run
3-21 tokens and a synchronous step waits for its longest. A character-level vocabulary of 16
tokens; the reward is the fraction of answer positions right (an exact answer scores 1; every
missing or extra token counts as wrong).

The supervised warm-up (`sft_examples`) teaches the reversal on every example, with a habit: most
answers (all but `reverse_frac`) end with a stray `=` before `<eos>`, which is never exact (it
scores n / (n + 2)). The warmed-up model reverses well but greedily adds the stray token
(exact-match accuracy ~0), while some of its samples stop right (35% of the examples did): pass@k
above pass@1, which is what RL converts quickly. GRPO finds that only exact answers are paid in
full and drops the habit, so greedy accuracy rises towards the reversal skill the warm-up gave
(most short and medium lists, few long ones).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from april_jax.data.types import PromptRecord

PAD, BOS, EOS, REV, EQ = 0, 1, 2, 3, 4
DIGIT0 = 5  # digits 0-9 are ids 5..14
VOCAB_SIZE = 16
LENGTH_BUCKETS = ((0.6, 2, 5), (0.25, 6, 10), (0.15, 11, 20))  # `data.reverse_lengths`' default
MAX_ANSWER = 21  # 20 digits + eos, with the default buckets


def parse_lengths(text: str) -> tuple[tuple[float, int, int], ...]:
    """'0.6:2-5,0.4:6-10' -> ((0.6, 2, 5), (0.4, 6, 10)). ValueError says what is wrong."""
    buckets = []
    for part in text.split(","):
        try:
            p, span = part.split(":")
            lo, hi = span.split("-")
            bucket = (float(p), int(lo), int(hi))
        except ValueError:
            raise ValueError(f"bucket {part.strip()!r} is not P:LO-HI") from None
        if not (bucket[0] > 0 and 1 <= bucket[1] <= bucket[2]):
            raise ValueError(f"bucket {part.strip()!r}: need P > 0 and 1 <= LO <= HI")
        buckets.append(bucket)
    if abs(sum(p for p, _, _ in buckets) - 1) > 1e-6:
        raise ValueError(f"probabilities sum to {sum(p for p, _, _ in buckets):g}, not 1")
    return tuple(buckets)


def sample_digits(rng: np.random.Generator, buckets=LENGTH_BUCKETS) -> list[int]:
    probs = [p for p, _, _ in buckets]
    lo, hi = buckets[rng.choice(len(buckets), p=probs)][1:]
    return rng.integers(0, 10, rng.integers(lo, hi + 1)).tolist()


def encode_prompt(digits: list[int]) -> list[int]:
    return [BOS, REV] + [DIGIT0 + d for d in digits] + [EQ]


def answer_ids(digits: list[int]) -> list[int]:
    return [DIGIT0 + d for d in reversed(digits)] + [EOS]


def decode(ids) -> str:
    names = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", REV: "R", EQ: "="}
    return " ".join(names.get(i, str(i - DIGIT0)) if i < VOCAB_SIZE else "?" for i in ids)


class ReverseTask:
    """Infinite deterministic prompt stream; `position` makes it resumable."""

    def __init__(self, seed: int, split: str = "train", buckets=LENGTH_BUCKETS):
        self.seed, self.split, self.position, self.buckets = seed, split, 0, buckets

    def _record(self, index: int) -> PromptRecord:
        rng = np.random.default_rng([self.seed, 0 if self.split == "train" else 1, index])
        digits = sample_digits(rng, self.buckets)
        return PromptRecord(
            uid=f"{self.split}:{index}",
            prompt_ids=encode_prompt(digits),
            answer=" ".join(map(str, digits[::-1])),
            source=f"reverse/{self.split}:{index}",
        )

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        record = self._record(self.position)
        self.position += 1
        return record

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def take(self, n: int) -> list[PromptRecord]:
        return list(itertools.islice(self, n))


def reward(response_ids, answer: str) -> float:
    target = [DIGIT0 + int(d) for d in answer.split()] + [EOS]
    got = list(response_ids)
    right = sum(a == b for a, b in zip(got, target))
    return right / max(len(got), len(target))


def stray_ids(digits: list[int]) -> list[int]:
    """The warm-up's habit, not paid in full: the reversal with a stray `=` before `<eos>`."""
    return answer_ids(digits)[:-1] + [EQ, EOS]


def sft_examples(
    seed: int, n: int, reverse_frac: float = 1.0, buckets=LENGTH_BUCKETS
) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs, all reversals: a `reverse_frac` share exact (the rewarded answer),
    the rest with a stray `=` before `<eos>`."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for _ in range(n):
        digits = sample_digits(rng, buckets)
        answer = answer_ids(digits) if rng.random() < reverse_frac else stray_ids(digits)
        out.append((encode_prompt(digits), answer))
    return out
