"""What the data side hands the rollout side: one prompt drawn from a dataset.

It lives under `data/` (not `rollout/`) so the datasets depend on nothing in the rollout code;
`rollout.types` builds its groups on it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PromptRecord:
    """One dataset row: `uid` is unique per draw (the same row in two epochs gets two uids)."""

    uid: str
    prompt_ids: list[int]
    answer: str | None = None
    source: str | None = None  # e.g. "file.jsonl:17", for error messages
    prompt: str | list | None = None  # the row's prompt as given (text or chat messages), for rewards
    fields: dict = dataclasses.field(default_factory=dict)  # the row's other fields (JSON values), for rewards
