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

    @classmethod
    def after(cls, signum: int, done: int | None, total: int, checkpoints) -> "Stopped":
        """Stopped after `done` finished steps (None: none, and no checkpoint) of `total`."""
        import signal

        name = signal.Signals(signum).name
        if done is None:
            return cls(
                signum,
                f"stopped by {name} before step 1 of {total} finished: nothing to save; rerun the "
                f"same command to start again",
            )
        return cls(
            signum,
            f"stopped by {name} after step {done} of {total}: checkpoint at {checkpoints}/{done}; "
            f"rerun the same command to resume",
        )


class TrainingError(RuntimeError):
    """The run cannot go on (it diverged, or every reward failed); the message says why and what was kept."""
