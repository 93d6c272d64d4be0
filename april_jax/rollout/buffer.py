"""The APRIL partial buffer: groups that were not delivered, kept whole, FIFO, serialisable.

A buffered group holds finished members (tokens, logprobs, versions, reward) and aborted members
(tokens, per-token behaviour logprobs and per-token versions so far). It also holds groups that
completed beyond a step's target. Beyond `capacity` groups the oldest are evicted and counted.
"""

from __future__ import annotations

import collections

from april_jax.rollout.types import Group


class PartialBuffer:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"rollout.buffer_capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._groups: collections.deque[Group] = collections.deque()
        self.evicted: list[Group] = []  # since the last `take_evicted()`

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Group) -> None:
        self._groups.append(group)
        while len(self._groups) > self.capacity:
            self.evicted.append(self._groups.popleft())

    def groups(self) -> list[Group]:
        """The buffered groups, oldest first (read-only view; `drain` takes them)."""
        return list(self._groups)

    def drain(self) -> list[Group]:
        groups, self._groups = list(self._groups), collections.deque()
        return groups

    def take_evicted(self) -> list[Group]:
        out, self.evicted = self.evicted, []
        return out

    def summary(self) -> dict:
        samples = [s for g in self._groups for s in g.samples]
        return {
            "groups": len(self._groups),
            "complete_groups": sum(g.complete for g in self._groups),
            "partial_samples": sum(1 for s in samples if not s.finished and s.response_ids),
            "tokens": sum(len(s.response_ids) for s in samples),
        }

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "groups": [g.to_dict() for g in self._groups]}

    def load_state_dict(self, state: dict) -> None:
        self.capacity = int(state["capacity"])
        self._groups = collections.deque(Group.from_dict(g) for g in state["groups"])
        self.evicted = []
