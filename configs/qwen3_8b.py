"""Qwen3-8B: the 4B recipe (configs/qwen3_4b.py) with the 8B checkpoint and tensor parallelism 2."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("qwen3_4b", Path(__file__).with_name("qwen3_4b.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
    c = _base.get_config("8b")
    c.train.micro_batch_size = 4
    c.mesh.fsdp, c.mesh.tensor = -1, 2
    return c
