"""Entry points, each runnable as `python -m april_jax.cli.NAME` and installed as a console script
(pyproject.toml): train (april-train), launch (april-launch), ckpt (april-ckpt), plot (april-plot),
demo (april-demo)."""


def prog(module: str) -> str:
    """The command as the user typed it: a console script's name (`april-ckpt`), else
    `python -m MODULE`, for usage lines and help."""
    import os
    import sys

    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("april-") else f"python -m {module}"
