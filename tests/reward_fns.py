"""Custom reward functions for the reward tests, one per call form (imported by the pool workers)."""

import asyncio
import os
import subprocess
import sys
import threading
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


# ---- reward code that misbehaves (tests/test_reward_isolation.py) ----


def interrupts(sample) -> float:
    raise KeyboardInterrupt


def exits_7(sample) -> float:
    raise SystemExit(7)


def returns_none(sample):
    """Forgot its `return`."""


@rewards.batched
def one_short(samples) -> list[float]:
    """A batched function that loses a score."""
    return [1.0] * (len(samples) - 1)


def dies(sample) -> float:
    os._exit(3)


def dies_after_returning(sample) -> float:
    """Its worker exits a moment after the call returned (a thread the reward left behind)."""
    threading.Thread(target=lambda: (time.sleep(0.2), os._exit(3))).start()
    return 1.0


def forks(sample) -> float:
    """Leaves processes running, as a sandbox or a judge server would: a `sleep` child, one in a
    session of its own (gone from the worker's group and, once the worker is, from its tree), and a
    forked copy of the worker that never execs (so without the pool's token in /proc/PID/environ).
    Their pids are appended to the file the sample's field `pids_file` names, else
    $APRIL_TEST_CHILD_PIDS (the CLI runs: a pool's forkserver keeps the environment it started with)."""
    children = [
        subprocess.Popen(["sleep", "300"]).pid,
        subprocess.Popen(["sleep", "300"], start_new_session=True).pid,
    ]
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(300)
        finally:
            os._exit(0)
    children.append(pid)
    with open(sample.fields.get("pids_file") or os.environ["APRIL_TEST_CHILD_PIDS"], "a") as f:
        f.write("".join(f"{p}\n" for p in children))
    return 1.0


def misbehaves(sample) -> float:
    """For the CLI run: by the sample's index in its group, a KeyboardInterrupt, a SystemExit(7),
    a worker that dies, or processes left running (scored 1: so each group has a score to learn from)."""
    if sample.index == 0:
        raise KeyboardInterrupt
    if sample.index == 1:
        sys.exit(7)
    if sample.index == 2:
        os._exit(3)
    return forks(sample)


def forks_and_hangs(sample) -> float:
    """Starts what `forks` starts, then is stuck (killed by reward.timeout_s)."""
    forks(sample)
    while True:
        time.sleep(1)
