"""Entry points, each runnable as `python -m april_jax.cli.NAME` and installed as a console script
(pyproject.toml): train (april-train), launch (april-launch), ckpt (april-ckpt), plot (april-plot),
demo (april-demo)."""
