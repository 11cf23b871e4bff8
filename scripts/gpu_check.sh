#!/usr/bin/env bash
# The GPU checks (tests/gpu/gpu_checks.py) as one prepared command: at most 5 minutes on one H200, one summary
# line per check as it finishes (a timeout still leaves results), a `result:` line at the end. Without CUDA it
# prints what it would run and why it skipped, and exits 0, unless --require-cuda (the run on a lent GPU: exit 3,
# one line). Extra arguments go to gpu_checks.py (--only, --tiny, --require-cuda).
# A GPU image without megatron-core: run `bash scripts/gpu_deps.sh` on the CPU machine first and carry .gpu_deps.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
# the wheels scripts/gpu_deps.sh made: unpacked (a wheel is a zip: no pip, no network) and first on PYTHONPATH
for wheel in .gpu_deps/*.whl; do
  [ -f "$wheel" ] || continue
  "$PY" -m zipfile -e "$wheel" .gpu_deps/site || { echo "error: cannot unpack $wheel" >&2; exit 2; }
done
[ -d .gpu_deps/site ] && export PYTHONPATH="$PWD/.gpu_deps/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export GPU_CHECK_TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-300}  # gpu_checks.py fits its children inside it
timeout --kill-after=10 "$GPU_CHECK_TIMEOUT_S" "$PY" tests/gpu/gpu_checks.py "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "result: gpu_check=timeout after ${GPU_CHECK_TIMEOUT_S:-300} s (the check lines above finished)"
fi
exit "$rc"
