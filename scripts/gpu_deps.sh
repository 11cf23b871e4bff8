#!/usr/bin/env bash
# Put what a bare GPU image lacks for scripts/gpu_check.sh into .gpu_deps/ (git-ignored; carry it to the GPU
# machine with the working tree): megatron-core's Python files from this checkout's .venv. Its one compiled part
# (dataset helpers) is not used by mgrpo, so the Python files work on any Python >= 3.10 and any torch >= 2.6.
# Usage: bash scripts/gpu_deps.sh [DEST]   (DEST defaults to .gpu_deps; the suite's rehearsal writes a temp folder)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_deps}
[ -x .venv/bin/python ] || { echo "error: .venv missing; run: bash scripts/setup.sh" >&2; exit 2; }
rm -rf "$DEST.tmp"
DEST_TMP="$DEST.tmp" .venv/bin/python - <<'PY'
import os, shutil
import megatron.core
src = os.path.dirname(os.path.dirname(megatron.core.__file__))  # .../site-packages/megatron
shutil.copytree(src, os.path.join(os.environ["DEST_TMP"], "megatron"),
                ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
print(f"megatron-core {megatron.core.__version__}: Python files copied from {src}")
PY
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "$DEST: $(du -sh "$DEST" | cut -f1); on the GPU machine: bash scripts/gpu_check.sh --require-cuda (it adds .gpu_deps to PYTHONPATH)"
