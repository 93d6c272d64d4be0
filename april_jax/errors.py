"""Errors shared across packages: one class per kind of bad input, so a caller catches it once."""


class CheckpointError(ValueError):
    """A checkpoint (an orbax training checkpoint, or a safetensors weights file or tensor) is
    missing or malformed; the message names the file, step or tensor."""


class Stopped(Exception):
    """SIGTERM / SIGINT stopped a training run after it wrote what it had: `line` says where the
    checkpoint is, `code` is the exit code (128 + the signal, what schedulers expect)."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.code, self.line = 128 + signum, line
