"""Small arithmetic word problems for a small instruct model to learn on CPU, with a held-out split.

"Mia has 11 pencils and gets 2 more. How many pencils does Mia have now?" SmolLM2-135M-Instruct
answers a third of the held-out set right at step 0, greedily (0.32 of 100): it often states the
right sum, then keeps talking and ends on another number, or wanders off (a few tokens up to the
budget, a long tail). The reward pays the last number of the response, so what RL fixes first is
consistency and stopping (the mean response shortens from ~50 to ~25 tokens in a dozen steps); the
arithmetic itself is mostly within the model's reach.

Problems are one of four kinds (gets more: a + b; gives away: a - b; bags: a x b; two steps:
a + b - c), drawn with a seeded `random.Random`. Split by arithmetic, not by wording: a problem is
held out when a hash of its kind and numbers falls in the eval share, so no training problem asks
the same sum as an evaluation problem under other names.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from random import Random

NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Noah", "Zoe", "Omar", "Ivy")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "shells", "cards", "coins", "balloons")
EVAL_SHARE = 0.2  # of the arithmetic combinations


def _problem(rng: Random) -> tuple[str, tuple, int]:
    """(question, (kind, numbers...), answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choices(("add", "sub", "mul", "two_step"), weights=(3, 3, 2, 2))[0]
    if kind == "add":
        a, b = rng.randint(2, 20), rng.randint(1, 9)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", (kind, a, b), a + b
    if kind == "sub":
        b = rng.randint(1, 9)
        a = rng.randint(b + 1, 20)
        return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", (kind, a, b), a - b
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 6)
        return (
            f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in all?",
            (kind, a, b),
            a * b,
        )
    a, b = rng.randint(2, 15), rng.randint(1, 9)
    c = rng.randint(1, a + b - 1)
    return (
        f"{name} has {a} {item}, gets {b} more, and then gives away {c}. How many {item} does {name} have left?",
        (kind, a, b, c),
        a + b - c,
    )


def is_held_out(arithmetic: tuple) -> bool:
    """Whether this kind and these numbers belong to the evaluation split (a stable hash, not `hash()`)."""
    digest = hashlib.sha256(repr(arithmetic).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < EVAL_SHARE


def generate(split: str, n: int, seed: int = 0) -> list[dict]:
    """`n` distinct problems of `split` ('train' or 'eval'): rows {prompt, answer, kind, numbers}. The same seed
    gives the same rows; the two splits never share an arithmetic combination. Evaluation problems
    are distinct in their arithmetic too, so that a few small products do not fill the split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    # each split draws from its own stream, so growing one split leaves the other's rows unchanged
    rng = Random(f"word-problems/{split}/{seed}")
    rows, seen = [], set()
    for _ in range(200 * n):
        question, arithmetic, answer = _problem(rng)
        key = arithmetic if split == "eval" else question
        if is_held_out(arithmetic) != (split == "eval") or key in seen:
            continue
        seen.add(key)
        rows.append({"prompt": question, "answer": str(answer), "kind": arithmetic[0], "numbers": list(arithmetic[1:])})
        if len(rows) == n:
            return rows
    raise ValueError(f"only {len(rows)} distinct {split} problems found, {n} asked")


def write(out: Path, split: str, n: int, seed: int = 0) -> Path:
    """The split as jsonl at `out` (written whole, then renamed: a reader never sees part of it)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in generate(split, n, seed)))
    os.replace(tmp, out)
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def reward(sample) -> float:
    """1.0 when the response's last number equals the answer (an integer), else 0.0. A correct sum
    followed by more talk that ends on another number scores 0: the answer must be what the
    response ends with."""
    number = last_number(sample["response"])
    try:
        return 1.0 if number is not None and float(number) == float(sample["answer"]) else 0.0
    except (TypeError, ValueError):
        return 0.0
