"""jsonl / parquet prompt datasets: configurable fields, seeded shuffling per epoch, a resumable
position, and errors that name the file and line of a bad row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from april_jax.rollout.types import PromptRecord


class DataError(ValueError):
    """A missing file or a malformed row; the message names it."""


def read_rows(path: str, prompt_key: str, answer_key: str) -> list[tuple[str, str, str]]:
    """[(prompt, answer, source)] where source is 'file:line' (jsonl) or 'file:row' (parquet)."""
    file = Path(path)
    if not file.exists():
        raise DataError(f"{file}: dataset file not found")
    rows = []
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(file).to_pylist()
        records = [(f"{file}:row {i}", r) for i, r in enumerate(table)]
    elif file.suffix in (".jsonl", ".json"):
        records = []
        with open(file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{file}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{n}: invalid JSON ({e.msg})") from None
    else:
        raise DataError(f"{file}: unsupported format (use .jsonl or .parquet)")
    for source, r in records:
        if not isinstance(r, dict) or prompt_key not in r or answer_key not in r:
            raise DataError(f"{source}: row lacks field {prompt_key!r} or {answer_key!r}")
        if not isinstance(r[prompt_key], str) or not r[prompt_key].strip():
            raise DataError(f"{source}: field {prompt_key!r} must be a non-empty string")
        rows.append((r[prompt_key], str(r[answer_key]), source))
    if not rows:
        raise DataError(f"{file}: no rows")
    return rows


class PromptDataset:
    """Endless epochs over the rows, each epoch shuffled with (seed, epoch). `uid` = epoch:index."""

    def __init__(self, rows, encode: Callable[[str], list[int]], *, seed: int = 0, shuffle: bool = True,
                 max_prompt_len: int = 0):
        self.rows, self.encode, self.seed, self.shuffle = rows, encode, seed, shuffle
        self.max_prompt_len = max_prompt_len
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        if self.index >= len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
        row = int(self._order(self.epoch)[self.index])
        prompt, answer, source = self.rows[row]
        uid = f"{self.epoch}:{self.index}"
        self.index += 1
        ids = self.encode(prompt)
        if self.max_prompt_len and len(ids) > self.max_prompt_len:
            raise DataError(f"{source}: prompt has {len(ids)} tokens, more than data.max_prompt_len={self.max_prompt_len}")
        return PromptRecord(uid=uid, prompt_ids=ids, answer=answer, source=source)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
