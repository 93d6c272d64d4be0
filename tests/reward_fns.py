"""Custom reward functions for the reward tests, one per call form (imported by the pool workers)."""

import asyncio
import time

from april_jax.rl import rewards


def explodes(response: str, answer: str) -> float:
    raise RuntimeError("judge crashed")


def text_answer(response: str, answer: str) -> float:
    """The old `(text, answer)` form."""
    return float(answer in response)


def uses_sample(sample) -> float:
    """The sample form: checks every part of the sample it is given."""
    ok = (
        sample["response"] == sample.response
        and isinstance(sample.prompt_ids, list)
        and sample.prompt_text
        and sample.finish_reason in ("stop", "length")
        and sample.fields.get("difficulty") == "easy"
    )
    return 1.0 if ok else -1.0


@rewards.batched
def by_group(samples) -> list[float]:
    """Batched form: the rank of each response length within the group."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response_ids))
    return [float(order.index(i)) for i in range(len(samples))]


async def awaits(sample) -> float:
    await asyncio.sleep(0.2)
    return float(len(sample.response_ids))


def hangs_on_seven(sample) -> float:
    """Stuck forever on answers containing 7 (a verifier caught in a loop), else 1."""
    if "7" in str(sample.answer):
        while True:
            time.sleep(1)
    return 1.0


def not_a_number(sample) -> float:
    return float("nan")


def slow(sample) -> float:
    time.sleep(0.5)
    return 1.0


def hangs(response: str, answer: str) -> float:
    """Stuck forever, whatever it gets (the CLI hang test)."""
    while True:
        time.sleep(1)


def chat_run(sample) -> float:
    """For the chat-data CLI run: hangs on answer 7 (killed by reward.timeout_s); else checks that
    the sample carries the chat messages and the row's fields, and rewards even lengths."""
    if sample.answer == "7":
        while True:
            time.sleep(1)
    if not (
        isinstance(sample.prompt, list)
        and sample.prompt[-1]["role"] == "user"
        and sample.prompt[-1]["content"] in sample.prompt_text
        and sample.fields["level"] == int(sample.answer)
    ):
        return -1.0
    return float(len(sample.response_ids) % 2 == 0)
