"""Command-line edges, each through the real command: one `error:` line naming the cause, and usage
lines naming the command the user typed."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def one_error_line(proc, *needles):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_config_argument_to_a_get_config_that_takes_none(tmp_path):
    proc = run([sys.executable, "-m", "april_jax.train", "--config", "configs/tiny.py:8b"])
    one_error_line(proc, "configs/tiny.py", "get_config() takes 0 positional arguments", "FILE:ARG")


def test_workdir_component_over_255_bytes(tmp_path):
    workdir = tmp_path / ("a" * 300)
    proc = run([sys.executable, "-m", "april_jax.train", "--config", "configs/tiny.py", f"--config.workdir={workdir}"])
    one_error_line(proc, "config key 'workdir'", "300 bytes", "255")
    assert list(tmp_path.iterdir()) == []  # nothing made


@pytest.mark.parametrize("script", ["april-demo", "april-ckpt", "april-plot", "april-launch", "april-train"])
def test_console_scripts_usage_names_the_command(script):
    if not (BIN / script).exists():
        pytest.skip(f"{script} is not installed in this interpreter's environment (pip install -e .)")
    proc = run([str(BIN / script), "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"usage: {script}" in proc.stdout and "python -m" not in proc.stdout.split("\n", 1)[0]
    if script == "april-demo":  # answers nothing: --help is not a question
        assert "loaded" not in proc.stdout and "Q: --help" not in proc.stdout


def test_launch_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(
            [
                sys.executable,
                "-m",
                "april_jax.cli.launch",
                "--nprocs",
                "2",
                "--port",
                str(port),
                "--config",
                "configs/tiny.py",
            ],
            timeout=120,
        )
    one_error_line(proc, f"--port {port}", "already in use")


def test_module_usage_names_python_m():
    proc = run([sys.executable, "-m", "april_jax.cli.ckpt", "--help"], timeout=120)
    assert proc.returncode == 0 and "usage: python -m april_jax.cli.ckpt" in proc.stdout
