#!/usr/bin/env bash
# Put what a bare GPU image lacks for scripts/gpu_check.sh into .gpu_deps/ (git-ignored; carry it to the GPU
# machine with the working tree): megatron-core's Python files from this checkout's .venv. Its one compiled part
# (dataset helpers) is not used by mgrpo, so the Python files work on any Python >= 3.10 and any torch >= 2.6.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "error: .venv missing; run: bash scripts/setup.sh" >&2; exit 2; }
rm -rf .gpu_deps.tmp
.venv/bin/python - <<'PY'
import os, shutil
import megatron.core
src = os.path.dirname(os.path.dirname(megatron.core.__file__))  # .../site-packages/megatron
shutil.copytree(src, ".gpu_deps.tmp/megatron", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
print(f"megatron-core {megatron.core.__version__}: Python files copied from {src}")
PY
rm -rf .gpu_deps && mv .gpu_deps.tmp .gpu_deps
echo ".gpu_deps: $(du -sh .gpu_deps | cut -f1); on the GPU machine: bash scripts/gpu_check.sh (it adds .gpu_deps to PYTHONPATH)"
