"""The receiving side of the `cuda_ipc` weight transport, without vLLM: a torch process on the same
GPU that maps the trainer's buffer through the real worker-extension code
(`april_jax.rollout.vllm.worker_ext.WeightUpdateExt.april_update_from_cuda_ipc`) and reports what it saw.

    python -m benchmarks.cuda_ipc_receiver --mode hash|copy   (from the repository root)

Reads one payload (`CudaIpcBucket.payload()`) per stdin line, answers one JSON line per payload:
{"tensors": n, "seconds": t, "sha256": {name: digest}} with `--mode hash` (each tensor's bytes,
hashed on the host: the test compares them with the sender's), or `--mode copy` (each tensor copied
into a preallocated tensor of this process, as vLLM's weight loader does; `seconds` then times the
map + copies). An empty line or EOF ends it. Only torch and the extension are imported: a vLLM
worker has no JAX.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from april_jax.rollout.vllm.worker_ext import WeightUpdateExt


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class RecordingRunner:
    """Stands in for vLLM's model runner: `reload_weights` is what the extension calls."""

    def __init__(self, mode: str):
        self.mode = mode
        self.digests: dict[str, str] = {}
        self.copies: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator) -> None:
        self.digests = {}
        for name, tensor in weights_iterator:
            if self.mode == "hash":
                self.digests[name] = tensor_sha256(tensor)
            else:
                if name not in self.copies:
                    self.copies[name] = torch.empty_like(tensor)
                self.copies[name].copy_(tensor)


class Receiver(WeightUpdateExt):
    def __init__(self, device: torch.device, runner: RecordingRunner):
        self.device = device
        self.model_runner = runner


class ReceiverProcess:
    """The sender's handle on a receiver subprocess: `send(payload)` -> its JSON answer."""

    def __init__(self, mode: str = "hash", device: int = 0, timeout_s: float = 180.0):
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cuda_ipc_receiver", "--mode", mode, "--device", str(device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [self._lines.put(x) for x in self.proc.stdout] + [self._lines.put("")], daemon=True
        ).start()
        self.hello = self._answer()

    def _answer(self) -> dict:
        try:
            line = self._lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"cuda_ipc receiver: no answer in {self.timeout_s:.0f} s") from None
        if not line:
            self.proc.wait(timeout=30)
            self._stderr.seek(0)
            raise RuntimeError(f"cuda_ipc receiver exited ({self.proc.returncode}): {self._stderr.read()[-3000:]}")
        return json.loads(line)

    def send(self, payload: str) -> dict:
        self.proc.stdin.write(payload + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._stderr.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("hash", "copy"), default="hash")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    runner = RecordingRunner(args.mode)
    receiver = Receiver(device, runner)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        payload = line.strip()
        if not payload:
            break
        t = time.perf_counter()
        n = receiver.april_update_from_cuda_ipc(payload)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
        print(json.dumps({"tensors": n, "seconds": seconds, "sha256": runner.digests}), flush=True)


if __name__ == "__main__":
    main()
