"""python -m april_jax.train --config configs/tiny.py [--config.a.b=value ...]
(also `python -m april_jax.cli.train`, or the `april-train` console script)

The command line of the training recipe (april_jax/train.py): the config from --config FILE and
its overrides, `--help [KEY.PREFIX]`, and bad input, a full disk or a stop as one line and an
exit code instead of a traceback.

SIGTERM / SIGINT (preemption, Ctrl-C): the step in progress is abandoned if its rollout is not
done yet (else it finishes), a checkpoint of the last finished step is written (unless one
exists), the engine and the reward workers are stopped, one line says where the checkpoint is,
and the exit code is 128 + the signal (143 / 130: a scheduler then retries the job, and rerunning
the same command resumes as if nothing had happened).
"""

from __future__ import annotations

import errno
import re
import shlex
import sys
import time
import warnings
from pathlib import Path

from april_jax import config as config_lib
from april_jax.cli import prog
from april_jax.config import ConfigError
from april_jax.config.loading import load_config
from april_jax.runtime import distributed
from april_jax.runtime.errors import Stopped, TrainingError

USAGE = """usage: python -m april_jax.train --config FILE [--config.KEY=VALUE ...]
       python -m april_jax.train --config FILE --plan [--plan-devices 8xH100-80GB] [--json]
       python -m april_jax.train --help [KEY.PREFIX]   (e.g. --help rollout, --help loss.kl_coef)

--plan prints the deployment plan (what trains and serves where, the bytes on every device) and
starts nothing; --plan-devices plans for other hardware (COUNTxNAME-MEMGB).

FILE is a Python file whose get_config() returns the config (configs/*.py); --config.KEY=VALUE
overrides one key. Keys (type, default; allowed values), each with what it does:
"""


def help_prefix(argv: list[str]) -> str | None:
    """The KEY.PREFIX of `--help [PREFIX]` / `--help=PREFIX` / `-h` ('' for all keys), or None."""
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--help="):
            return arg.split("=", 1)[1]
        if arg in ("--help", "-h", "--helpfull"):
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if following.startswith("-") else following
    return None


def fail(message: str) -> None:
    """One clear line on stderr and exit 2: bad input is not a traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def fail_on_disk(message: str) -> None:
    """`fail` for a write the disk refused. Orbax's async writer leaves the refused write's coroutine
    unawaited; Python would warn about it at exit, after the one error line, so that warning is muted."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    fail(message)


def main(argv: list[str] | None = None) -> None:
    from april_jax.train import run

    argv = list(sys.argv if argv is None else argv)
    prefix = help_prefix(argv)
    if prefix is not None:
        try:
            keys = config_lib.help_text(prefix)
        except ConfigError as e:
            fail(str(e))
        usage = USAGE.replace("python -m april_jax.train", prog("april_jax.train"))
        print((usage + "\n" if not prefix else "") + keys)
        return
    plan_args, argv = split_plan_args(argv)
    if plan_args is not None:
        show_plan(argv, **plan_args)
        return
    stop = distributed.StopSignal().install()  # from here on a signal only asks the loop to stop
    c = None
    try:
        c = load_config(argv)
        started = time.perf_counter()
        run(c, stop)
        if distributed.is_main():
            print(closing_summary(c, argv, time.perf_counter() - started), file=sys.stderr)
    except Stopped as e:
        print(e.line, file=sys.stderr)
        raise SystemExit(e.code) from None
    except ConfigError as e:
        fail(str(e))
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # a path in the config: the message names it
            fail(str(e))
        if e.errno not in DISK_ERRORS:
            raise
        # a full disk, or a folder the run cannot write: the checkpoints written before are intact
        fail_on_disk(f"{e.filename or (c and c.workdir) or 'writing the run'}: {e.strerror or e}{RERUN}")
    except (ValueError, TrainingError) as e:
        _fail_on_bad_input(e)
        raise
    except RuntimeError as e:
        from april_jax.rollout.vllm.server import VllmStartError

        if isinstance(e, VllmStartError):  # a server that cannot start: its own reason, not our traceback
            fail(str(e))
        raise
    finally:
        stop.uninstall()


def closing_summary(c, argv: list[str], seconds: float) -> str:
    """What a finished run says last: its steps and time, the last held-out eval, the last
    checkpoint, and the commands that come next."""
    from april_jax.training.metrics import read_metrics

    workdir = Path(c.workdir)
    rows = read_metrics(workdir)
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit())
    lines = [f"done: {c.train.total_steps} steps ({seconds / 60:.1f} min this time)"]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"  eval/accuracy {last['eval/accuracy']:.2f} after step {last['step']} "
            f"(first eval {first['eval/accuracy']:.2f}; temperature {c.eval.temperature:g}, "
            f"{c.eval.num_prompts} prompts x {c.eval.n_samples})"
        )
    if steps:
        lines.append(f"  last checkpoint: {workdir / 'checkpoints' / str(steps[-1])}")
    kept = [a for a in argv[1:] if not a.startswith("--config.train.total_steps")]
    command = " ".join([prog("april_jax.train"), *map(shlex.quote, kept)])
    lines += [
        f"  more steps: {command} --config.train.total_steps=N (resumes from the last checkpoint)",
        f"  plot:       {_sibling('plot')} {shlex.quote(str(workdir))}",
        f"  export:     {_sibling('ckpt')} export-hf {shlex.quote(str(workdir))} OUT",
    ]
    return "\n".join(lines)


def _sibling(name: str) -> str:
    """Another entry point in the form the user ran this one: `april-NAME` or `python -m april_jax.cli.NAME`."""
    return f"april-{name}" if prog("april_jax.train").startswith("april-") else f"python -m april_jax.cli.{name}"


def split_plan_args(argv: list[str]) -> tuple[dict | None, list[str]]:
    """`--plan`, `--plan-devices SPEC` and `--json` taken out of argv: (their values or None, the rest)."""
    rest, found, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plan":
            found["plan"] = True
        elif arg == "--json":
            found["as_json"] = True
        elif arg == "--plan-devices" or arg.startswith("--plan-devices="):
            if "=" in arg:
                found["spec"] = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                found["spec"], i = argv[i + 1], i + 1
            else:
                fail("--plan-devices needs a spec, e.g. 8xH100-80GB")
        else:
            rest.append(arg)
        i += 1
    if not found:
        return None, rest
    if not found.pop("plan", False):
        fail("--plan-devices and --json go with --plan (python -m april_jax.train --config FILE --plan ...)")
    return found, rest


def show_plan(argv: list[str], spec: str | None = None, as_json: bool = False) -> None:
    """Print the deployment plan and start nothing: no JAX backend, no workdir, no server. Exit 2
    (after the plan) when it does not fit."""
    from april_jax.training import devices as devices_lib
    from april_jax.training.plan import make_plan

    try:
        c = load_config(argv)
        devices = devices_lib.parse_spec(spec) if spec else devices_lib.local_devices()
        plan = make_plan(c, devices)
    except (ConfigError, devices_lib.DeviceSpecError, FileNotFoundError) as e:
        fail(str(e))
    print(plan.to_json() if as_json else plan.table())
    if not plan.fits:
        fail(plan.error_line())


def _fail_on_bad_input(e: Exception) -> None:
    """One line and exit 2 for bad data, a bad checkpoint or tokenizer, a run that cannot go on, or a
    full disk under orbax; anything else returns (a traceback: a bug)."""
    from april_jax.data.dataset import DataError
    from april_jax.data.tokenizer import TokenizerError
    from april_jax.runtime.errors import CheckpointError

    if isinstance(e, (DataError, CheckpointError, TokenizerError, TrainingError)):
        fail(str(e))
    if DISK_FULL_TEXT in str(e):  # orbax reports tensorstore's write errors as ValueError
        where = re.search(r"/[^\"'\s]*/checkpoints/\d+", str(e))
        fail_on_disk(f"writing checkpoint {where.group(0) if where else ''}: {DISK_FULL_TEXT}{RERUN}")


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
DISK_FULL_TEXT = "No space left on device"
RERUN = " (the checkpoints before it are intact: fix this and rerun the same command to resume)"


if __name__ == "__main__":
    main()
