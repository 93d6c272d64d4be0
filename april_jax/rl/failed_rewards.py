"""A step of groups whose every reward failed trains nothing: a broken reward function is not a
zero reward. The marks are set here, where the scores come back, and read by the training loop."""

from __future__ import annotations


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
