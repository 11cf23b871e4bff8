#!/usr/bin/env bash
# Run the test suite (CPU). Extra arguments go to pytest. pytest's exit 5 (no tests ran) is a failure.
# Two xdist workers (MGRPO_TEST_WORKERS; 0 runs serially): a one-process test leaves the second core idle. Each
# worker takes whole work units, a module or the layout launches' users (tests/conftest.py), longest first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: .venv missing; run: bash scripts/setup.sh" >&2; exit 2; }
# one OpenMP thread per process: two workers and their launches keep both cores busy; threads beyond that spin
# (measured: a TP2xPP2 launch 46 s with 2 threads, 40 s with 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
WORKERS=${MGRPO_TEST_WORKERS:-2}
XDIST=()
[ "$WORKERS" -gt 0 ] && XDIST=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder)
"$PY" -m pytest -q -p no:cacheprovider --durations=40 "${XDIST[@]}" "${@:-tests}"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests (exit 5)" >&2
  exit 1
fi
exit "$rc"
