"""Stopping a set of processes that may still grow: SIGTERM, a grace period, SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def terminate(
    find: Callable[[], list[int]],
    grace: float,
    settle: float,
    poll: float = 0.1,
    each_round: Callable[[list[int]], None] | None = None,
) -> list[int]:
    """SIGTERM what `find` returns, SIGKILL what is still there after `grace` seconds, and wait
    (`settle` seconds more at most) until `find` returns nothing. `find` runs every round, so a
    process started meanwhile goes too; `each_round` sees each round's pids. The pids signalled."""
    signalled: set[int] = set()
    deadline = time.monotonic() + grace
    while pids := find():
        if each_round is not None:
            each_round(pids)
        now = time.monotonic()
        if now > deadline + settle:
            break
        for pid in pids:
            if now < deadline and pid in signalled:
                continue
            try:
                os.kill(pid, signal.SIGTERM if now < deadline else signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            signalled.add(pid)
        time.sleep(poll)
    return sorted(signalled)
