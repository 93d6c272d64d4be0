"""One trainer per workdir: an exclusive `fcntl.flock` on WORKDIR/.lock for the run's lifetime.

Two trainers on one workdir would interleave metrics.jsonl / delivered.jsonl and race on the
checkpoints. The kernel releases a flock when its process dies (kill -9 included), so a crashed
run never leaves a stale lock behind and a restart resumes at once.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from april_jax.config import ConfigError

LOCK_NAME = ".lock"


class WorkdirLock:
    def __init__(self, workdir):
        self.workdir = Path(workdir)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Create the workdir if needed and lock it; fails with one line if another trainer holds it."""
        if self._fd is not None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.workdir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"workdir {self.workdir} is in use by another trainer (it holds "
                f"{self.workdir / LOCK_NAME}); wait for it or choose another --config.workdir"
            ) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


NAME_MAX = 255  # bytes in one path component on Linux file systems (ext4, xfs, tmpfs)


def check_workdir(value: str) -> Path:
    """The run's folder, checked before anything is loaded: an empty value (an unset shell
    variable) would train in the current folder and overwrite whatever config.json is there."""
    if not str(value).strip():
        raise ConfigError(
            "config key 'workdir' is empty (an unset shell variable?): name the run's own folder, "
            "e.g. --config.workdir=runs/NAME"
        )
    workdir = Path(value)
    too_long = next((part for part in workdir.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if too_long is not None:
        raise ConfigError(
            f"config key 'workdir': the folder name {too_long[:40]!r}... is {len(os.fsencode(too_long))} bytes "
            f"long; file systems take at most {NAME_MAX}"
        )
    for folder in reversed([workdir, *workdir.parents]):  # from the root down: the first file names the problem
        if folder.exists() and not folder.is_dir():
            where = "is a file" if folder == workdir else f"is under {folder}, which is a file"
            raise ConfigError(f"config key 'workdir'={value!r} {where}, not a folder")
    nearest = next(p for p in [workdir, *workdir.parents] if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"config key 'workdir'={value!r}: {nearest} is not writable")
    return workdir
