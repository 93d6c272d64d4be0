"""The training config.

- schema.py: the machinery: a key declared once as a dataclass field (`key(...)`), with its type,
  default, allowed values and doc; the checks, the ConfigDict and the --help text come from it.
- keys.py: every key of the training config (`Config`), `default_config()`, `validate()` and the
  runtime dataclasses resolved from the keys (`rollout_cfg`, `loss_cfg`, `optimizer_cfg`).
- loading.py: the config of a run from `--config FILE` and `--config.KEY=VALUE` overrides.

`from april_jax import config` offers keys.py's names (`config.default_config()`, as in
configs/*.py). They load on first use: the runtime dataclasses declare their keys with schema.py
(rl/losses.py, rl/train_step.py, rollout/config.py import it), and keys.py imports those classes, so
importing keys.py here, eagerly, would make each import of schema.py wait for itself.
"""

import importlib
import typing

from april_jax.config.schema import ConfigError as ConfigError  # at once: schema.py imports nothing of ours

if typing.TYPE_CHECKING:  # what __getattr__ offers, for type checkers and editors
    from april_jax.config.keys import *  # noqa: F403


def __getattr__(name: str):
    if not name.startswith("__"):
        keys = importlib.import_module("april_jax.config.keys")
        if hasattr(keys, name):
            return getattr(keys, name)
    raise AttributeError(f"module 'april_jax.config' has no attribute {name!r}")
