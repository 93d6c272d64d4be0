"""jsonl / parquet prompt datasets: configurable fields, seeded shuffling per epoch, a resumable
position, and errors that name the file and line of a bad row.

A prompt is a string or a list of chat messages `[{"role": ..., "content": ...}]` (verl's and
TRL's format; the roles chat templates know); the row's other fields travel with it to the reward
function."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from april_jax.data.types import PromptRecord

# A template ignores (or fails on) a role it does not know: "wizard" would vanish from the prompt.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A missing file or a malformed row; the message names it."""


def irregular_kind(file: Path) -> str | None:
    """What `file` is when it is not a regular file ('a FIFO', 'a device', ...), else None. A FIFO
    or a device would block its reader forever, or stream without end; `stat` tells without opening it."""
    mode = file.stat().st_mode
    if stat.S_ISREG(mode):
        return None
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a plain file"
    )


def _json_safe(value):
    """Row fields as JSON values (they are saved with the APRIL buffer in checkpoints)."""
    return json.loads(json.dumps(value, default=str))


def check_prompt(prompt, source: str, key: str) -> None:
    """A non-empty string, or a non-empty list of {"role": str, "content": str} messages."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{source}: field {key!r} must be a non-empty string or a list of chat messages")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{source}: field {key!r} must be a non-empty string or a list of chat messages")
    for i, msg in enumerate(prompt):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
            raise DataError(
                f"{source}: field {key!r} message {i} must be {{'role': str, 'content': str}}, got {str(msg)[:80]}"
            )
        if msg["role"] not in CHAT_ROLES:
            raise DataError(
                f"{source}: field {key!r} message {i} has role {msg['role'][:40]!r}, expected one of "
                f"{', '.join(CHAT_ROLES)}"
            )


def read_rows(path: str, prompt_key: str, answer_key: str, key: str = "data.train_path") -> list[tuple]:
    """[(prompt, answer, source, other fields)] where source is 'file:line' (jsonl) or 'file:row'
    (parquet) and prompt is a string or a list of chat messages. `key`: the config key that named
    the file, for the messages about the file itself."""
    file = Path(path)
    if not file.exists():
        raise DataError(f"{file}: dataset file not found")
    rows = []
    if file.is_dir():
        raise DataError(f"{file}: a directory, not a dataset file")
    kind = irregular_kind(file)
    if kind:
        raise DataError(
            f"config key {key!r}={str(path)!r}: {kind}, not a regular file (give a .jsonl or .parquet file)"
        )
    if file.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(file).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{file}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        records = [(f"{file}:row {i}", r) for i, r in enumerate(table)]
    elif file.suffix in (".jsonl", ".json"):
        records = []
        with open(file, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{file}:{n}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                    ) from None
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
        prompt = r[prompt_key]
        if isinstance(prompt, tuple) or (hasattr(prompt, "tolist") and not isinstance(prompt, str)):
            prompt = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        check_prompt(prompt, source, prompt_key)
        fields = {k: v for k, v in r.items() if k not in (prompt_key, answer_key)}
        rows.append((prompt, str(r[answer_key]), source, _json_safe(fields)))
    if not rows:
        raise DataError(f"{file}: no rows")
    return rows


class PromptDataset:
    """Endless epochs over the rows, each epoch shuffled with (seed, epoch). `uid` = epoch:index."""

    def __init__(
        self,
        rows,
        encode: Callable[[str | list], list[int]],
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_prompt_len: int = 0,
        overlong: str = "error",
    ):
        self.rows, self.encode, self.seed, self.shuffle = rows, encode, seed, shuffle
        self.max_prompt_len = max_prompt_len
        self.epoch, self.index = 0, 0
        self.skipped: list[str] = []  # sources of prompts dropped as longer than max_prompt_len
        self.longest: tuple[int, str] | None = None  # (tokens, source) of the longest prompt kept
        if max_prompt_len:
            self._check_lengths(overlong)

    def _check_lengths(self, overlong: str) -> None:
        """Every prompt is encoded once up front: a long one fails now, naming its row, not when drawn
        hours in (and again on every resume); with overlong='skip' it is left out and counted."""
        fits = []
        for row in self.rows:
            try:
                n = len(self.encode(row[0]))
            except ValueError as e:  # the tokenizer's: a chat template that fails, or refuses, on this row
                raise DataError(f"{row[2]}: {e}") from None
            if n <= self.max_prompt_len:
                fits.append(row)
                if self.longest is None or n > self.longest[0]:
                    self.longest = (n, row[2])
            elif overlong == "skip":
                self.skipped.append(row[2])
            else:
                raise DataError(
                    f"{row[2]}: prompt has {n} tokens, more than data.max_prompt_len={self.max_prompt_len} "
                    f"(raise it, or set data.overlong_prompt=skip)"
                )
        if not fits:
            raise DataError(
                f"{self.rows[0][2].rsplit(':', 1)[0]}: every prompt is longer than "
                f"data.max_prompt_len={self.max_prompt_len}"
            )
        self.rows = fits

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        if self.index >= len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
        row = int(self._order(self.epoch)[self.index])
        prompt, answer, source, *rest = self.rows[row]
        uid = f"{self.epoch}:{self.index}"
        self.index += 1
        ids = self.encode(prompt)
        return PromptRecord(
            uid=uid, prompt_ids=ids, answer=answer, source=source, prompt=prompt, fields=rest[0] if rest else {}
        )

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
