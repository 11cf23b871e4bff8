#!/usr/bin/env bash
# Put what a bare GPU image lacks for scripts/gpu_check.sh into .gpu_deps/ (git-ignored; carry it to the GPU
# machine with the working tree): megatron-core 0.16.1 as a pure-Python wheel built from this checkout's .venv
# (its files, METADATA and a RECORD of sha256 digests). Its one compiled part (dataset helpers) is not used by
# mgrpo, so the wheel is tagged py3-none-any: any Python >= 3.10, any torch >= 2.6. scripts/gpu_check.sh unpacks
# it into .gpu_deps/site (a wheel is a zip; no pip or network needed there) and puts that first on PYTHONPATH.
# Usage: bash scripts/gpu_deps.sh [DEST]   (DEST defaults to .gpu_deps; the suite's rehearsal writes a temp folder)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_deps}
[ -x .venv/bin/python ] || { echo "error: .venv missing; run: bash scripts/setup.sh" >&2; exit 2; }
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
DEST_TMP="$DEST.tmp" .venv/bin/python - <<'PY'
import base64, hashlib, os, zipfile
from importlib import metadata

dist = metadata.distribution("megatron-core")
name, version = "megatron_core", dist.version
info = f"{name}-{version}.dist-info"
wheel = os.path.join(os.environ["DEST_TMP"], f"{name}-{version}-py3-none-any.whl")
record = []


def add(zf, arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    zf.writestr(arcname, data)
    record.append(f"{arcname},sha256={digest},{len(data)}")


with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
    files = sorted(str(f) for f in dist.files if str(f).startswith("megatron/") and str(f).endswith(".py"))
    for f in files:
        add(zf, f, dist.locate_file(f).read_bytes())
    add(zf, f"{info}/METADATA", dist.read_text("METADATA").encode())
    add(zf, f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: mgrpo scripts/gpu_deps.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    add(zf, f"{info}/top_level.txt", b"megatron\n")
    zf.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
print(f"megatron-core {version}: {len(files)} Python files -> {os.path.basename(wheel)}")
PY
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "$DEST: $(du -sh "$DEST" | cut -f1); on the GPU machine: bash scripts/gpu_check.sh --require-cuda (it unpacks the wheel)"
