"""A rollout server's delta base: the bucket files of the version it last loaded, kept in its staging folder.

A full push: the staged files load as they are, and `keep(version, paths)` makes them the base (renamed out of
staging's way, mapped shared and writable). A delta push: `prepare(version, paths)` checks every staged bucket names
the base's version (else `NeedFull`, nothing touched), then writes each bucket into the base files in place
(`mgrpo.weights.delta.DeltaBase`: XOR, then each tensor's digest) and returns the base files, which the worker
loads as it would a full push's. A digest that does not match drops the base (`NeedFull`; the sender pushes the
whole version in the same step) before anything is loaded; a load that fails after an in-place apply drops it too
(`forget`): the next push is full. Memory: one copy of the model in the wire dtype in /dev/shm (RAM), held only
while the trainer asks for it (`keep_base` in its commit); a delta adds only its own staged bytes.
"""

from __future__ import annotations

import mmap
import os
import time

from mgrpo.weights.bucket import read_bucket
from mgrpo.weights.delta import DeltaBase, NeedFull


class DeltaStore:
    def __init__(self, folder: str):
        self.folder, self.delta = folder, DeltaBase()
        self.files: list = []  # (path, file, mmap) of the base, in bucket order
        self.apply_s = 0.0

    @property
    def version(self) -> int | None:
        return self.delta.version

    def prepare(self, version: int, paths: list) -> tuple:
        """(files to load, whether they are a delta applied to the base): a full push's staged files as they
        are; a delta's buckets written into the base, whose files are returned."""
        t0 = time.perf_counter()
        manifests = [_manifest(p) for p in paths]  # headers only, read once
        if not any("delta" in m for m in manifests):
            return paths, False
        for m in manifests:
            self.delta.check(m, version, who="rollout server")
        try:
            for path in paths:
                with open(path, "rb") as f:
                    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                try:
                    bucket = read_bucket(buf)
                    who = f"rollout server, bucket {bucket.manifest.get('index')}"
                    self.delta.apply(bucket.manifest, bucket.tensors(), version, who=who)
                finally:
                    bucket = None
                    _close_map(buf)
        except NeedFull:
            self.forget()
            raise
        self.apply_s = time.perf_counter() - t0
        return [p for p, _, _ in self.files], True

    def keep(self, version: int, paths: list) -> None:
        """After a load: the loaded files are the base of `version` (a full push's are renamed into place)."""
        if paths == [p for p, _, _ in self.files]:
            self.delta.version = version  # a delta, applied in place
            return
        self.forget()
        tensors = {}
        for i, path in enumerate(paths):
            keep = os.path.join(self.folder, f"base-{i:06d}.bucket")
            os.replace(path, keep)
            f = open(keep, "r+b")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE)
            self.files.append((keep, f, buf))
            tensors.update(read_bucket(buf).tensors())
        self.delta.set(version, tensors)

    def forget(self) -> None:
        self.delta.forget()
        for path, f, buf in self.files:
            _close_map(buf)
            f.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        self.files = []


def _manifest(path: str) -> dict:
    from mgrpo.weights.bucket import parse_bucket_header

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(0)
        return parse_bucket_header(f.read(8 + n))[1]


def _close_map(buf) -> None:
    try:
        buf.close()
    except BufferError:  # a tensor view still alive: the mapping goes with it
        pass
