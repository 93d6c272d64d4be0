"""A step of groups whose every reward failed trains nothing: a broken reward function is not a
zero reward. The marks are set here, where the scores come back, and read by the training loop.

What failed is kept too (`FailureLog`): a count in `reward/failures` says that rewards fail, not
why, and a run that stops on failed rewards must say which function failed on which sample, how."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class MarkFailedRewards:
    """Wraps a GroupScorer: a group whose every reward failed (an exception, NaN or a timeout: the
    model counts them) has its samples marked, so that a step of such groups trains nothing. The
    mark travels with buffered groups (delivered, or checkpointed, in a later step)."""

    def __init__(self, scorer, reward):
        self.scorer, self.reward = scorer, reward

    def submit_group(self, group):
        return MarkedScores(self.scorer.submit_group(group), group, self.reward)


class MarkedScores:
    def __init__(self, pending, group, reward):
        self.pending, self.group, self.reward, self._result = pending, group, reward, None

    def done(self) -> bool:
        return self.pending.done()

    def __getattr__(self, name):  # futures and whatever else APRIL reads from a PendingScores
        return getattr(self.pending, name)

    def result(self) -> list[float]:
        if self._result is None:
            before = self.reward.failures + self.reward.timeouts
            self._result = self.pending.result()
            failed = self.reward.failures + self.reward.timeouts - before >= len(self.group.samples)
            for s in self.group.samples:
                s.metadata["reward_failed"] = failed
        return self._result


def all_failed(groups) -> bool:
    """Every sample of the step's groups is marked: nothing to learn from."""
    return all(s.metadata.get("reward_failed") for g in groups for s in g.samples)


class FailureLog:
    """The failed scores of a RewardModel (`add`: sample, function, exception type and message),
    written by the training loop once per step (`write`) to WORKDIR/reward_failures.jsonl: one line
    per kind (exception type) and step, with the kind's first sample and how many failed so. The
    terminal gets one warning the first time a kind appears in the run (a run that goes on with
    some rewards failing says so once, not every step), and a run stopped on failed rewards quotes
    the first failure of its skipped steps (`cause`)."""

    FILE = "reward_failures.jsonl"

    def __init__(self):
        self.step: dict[str, dict] = {}  # this step's records, by kind
        self.first: dict | None = None  # the first failure since the last step that trained
        self.latest: dict | None = None  # the first failure of the last step that had any
        self.path: Path | None = None
        self._warned: set[str] = set()

    def add(self, fn: str, sample: str, error: str, message: str) -> None:
        record = self.step.get(error)
        if record is None:
            message = " ".join(message.split())
            message = message if len(message) <= 300 else message[:297] + "..."
            record = self.step[error] = {"sample": sample, "fn": fn, "error": error, "message": message, "count": 0}
            if not self.first:
                self.first = record
        record["count"] += 1

    def write(self, workdir, step: int, trained: bool) -> None:
        """The step's records to the workdir (process 0 alone writes there; the others score
        nothing); `trained`: the step updated the policy, so a later stop quotes later failures."""
        from april_jax.runtime import distributed
        from april_jax.training.metrics import truncate_log

        records, self.step = list(self.step.values()), {}
        if records:
            self.latest = records[0]
        if trained:
            self.first = None
        if not distributed.is_main():
            return
        path = Path(workdir) / self.FILE
        if self.path != path:  # the run's first step here: a resumed run redoes the steps after its checkpoint
            truncate_log(path, step)
            self.path = path
        if not records:
            return
        with open(path, "a") as f:
            f.write("".join(json.dumps({"step": step, **r}) + "\n" for r in records))
        for r in records:
            if r["error"] not in self._warned:
                self._warned.add(r["error"])
                counter = "reward/timeouts" if r["error"] == "TimeoutError" else "reward/failures"
                print(
                    f"warning: step {step}: {self.describe(r)} (scored 0 and counted in {counter}; "
                    f"each step's failures by kind: {path})",
                    file=sys.stderr,
                )

    @staticmethod
    def describe(record: dict) -> str:
        what = f"{record['error']}: {record['message']}" if record["message"] else record["error"]
        return f"{record['fn']} on sample {record['sample']}: {what}"

    def cause(self) -> str:
        """Why every reward failed, for the line that stops the run."""
        record = self.first or self.latest
        if record is None:  # failures scored before a resume, or on another process
            return "an exception, NaN or a timeout"
        where = f"; each step's failures: {self.path}" if self.path else ""
        return f"first failure: {self.describe(record)}{where}"
