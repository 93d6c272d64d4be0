"""Errors shared across packages: one class per kind of bad input, so a caller catches it once."""


class CheckpointError(ValueError):
    """A checkpoint (an orbax training checkpoint, or a safetensors weights file or tensor) is
    missing or malformed; the message names the file, step or tensor."""
