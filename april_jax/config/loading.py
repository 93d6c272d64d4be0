"""The config of a run from its command line: `--config FILE` (a Python file whose get_config()
returns the config) and `--config.KEY=VALUE` overrides, checked and validated, with every
`asset:NAME` path resolved. Each kind of bad input is a ConfigError naming the file or key."""

from __future__ import annotations

from pathlib import Path

from april_jax.config import keys
from april_jax.config.schema import ConfigError


def _check_config_file(argv: list[str]) -> str:
    """The --config FILE, checked to exist and to parse (absl's own errors do not name it)."""
    file = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    file = file or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if not file:
        raise ConfigError("missing --config FILE (e.g. --config configs/tiny.py; --help lists every key)")
    path = Path(file.split(":", 1)[0] if not Path(file).exists() else file)  # FILE:arg selects a variant
    if not path.is_file():
        raise ConfigError(f"config file {file}: not found")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as e:
        raise ConfigError(f"config file {path}:{e.lineno}: syntax error ({e.msg})") from None
    except ValueError as e:  # null bytes and the like
        raise ConfigError(f"config file {path}: {e}") from None
    return str(path)


def _flag_error_line(text: str, file: str) -> str:
    """absl's message in one line with its reason: a config file that failed to parse puts the
    reason on the traceback's last line (e.g. `get_config() takes 0 positional arguments`)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Error whilst parsing config file" in text and len(lines) > 1:
        reason = lines[-1]
        if "get_config() takes 0 positional arguments" in reason:
            reason += " (FILE:ARG passes ARG to get_config(); this file's takes none)"
        return f"config file {file}: {reason}"
    return lines[0] if lines else text


def load_config(argv: list[str]):
    """Parse --config FILE and --config.* overrides with ml_collections config_flags."""
    from absl import flags
    from ml_collections import config_flags

    keys.check_overrides(argv)
    file = _check_config_file(argv)
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "training config file", flag_values=fv, lock_config=True, sys_argv=argv
    )
    try:
        fv(argv)
    except SystemExit as e:  # get_config() called sys.exit: nothing to train, but not a success either
        raise ConfigError(
            f"config file {file}: get_config() called sys.exit({e.code!r}) instead of returning a config"
        ) from None
    except (flags.Error, KeyError, TypeError, ValueError) as e:
        raise ConfigError(_flag_error_line(str(e), file)) from None
    except Exception as e:  # the config file's own code failed (get_config raised): name the file
        raise ConfigError(
            f"config file {file}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    from ml_collections import ConfigDict

    if not isinstance(fv.config, ConfigDict):
        raise ConfigError(
            f"config file {file}: get_config() returned {type(fv.config).__name__}, not a config "
            f"(return april_jax.config.default_config() with your changes)"
        )
    c = keys.validate(fv.config)
    from april_jax import assets

    with c.unlocked():
        c.model.path = assets.resolve(c.model.path)
        c.data.train_path = assets.resolve(c.data.train_path)
        c.data.eval_path = assets.resolve(c.data.eval_path)
        c.data.tokenizer_path = assets.resolve(c.data.tokenizer_path)
        c.loss.ref_path = assets.resolve(c.loss.ref_path)
    return c
