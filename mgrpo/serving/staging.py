"""Where a rollout server keeps the buckets of the weight version it is receiving: files in a private folder in
/dev/shm that the vLLM worker maps at commit.

A bucket is written to a temporary file and renamed into place only once its digest checked, so a file the
worker may have mapped is never truncated or rewritten (a second PUT of the same index makes a new file), and a
body that fails half-way (the client gone, a bad digest, the disk full) leaves nothing behind. Per version at most
`max_buckets` buckets and `max_total_bytes` bytes are staged (defaults from the model's size). The folder carries
the server's pid (`mgrpo-staging-PID-*`); folders of servers that are gone are swept at start.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

from mgrpo.fsutil import pid_alive

BASE = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class StagingFull(ValueError):
    """A bucket over the per-version caps; the message names the cap and its flag."""


def sweep_stale(base: str = BASE) -> list:
    """Remove the staging folders of servers that are no longer running; returns what was removed."""
    removed = []
    for path in glob.glob(os.path.join(base, "mgrpo-staging-*")):
        m = re.match(r"mgrpo-staging-(\d+)-", os.path.basename(path))
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Staging:
    def __init__(self, max_bytes: int, max_buckets: int = 1 << 20, max_total_bytes: int = 1 << 62):
        sweep_stale()
        self.dir = tempfile.mkdtemp(prefix=f"mgrpo-staging-{os.getpid()}-", dir=BASE)
        os.chmod(self.dir, 0o700)
        self.max_bytes, self.max_buckets, self.max_total_bytes = max_bytes, max_buckets, max_total_bytes
        self.version, self.buckets = None, {}  # index -> (path, sha256, bytes)

    def staged_bytes(self) -> int:
        return sum(n for _, _, n in self.buckets.values())

    def admit(self, version: int, index: int, size: int) -> None:
        """Start a bucket: a new version drops what was staged for another; raises StagingFull past a cap."""
        if self.version != version:
            self.reset(version)
        if index not in self.buckets and len(self.buckets) >= self.max_buckets:
            raise StagingFull(
                f"version {version} already has {len(self.buckets)} buckets staged, the cap (--max-staged-buckets)"
            )
        old = self.buckets.get(index, (None, None, 0))[2]
        if self.staged_bytes() - old + size > self.max_total_bytes:
            raise StagingFull(
                f"staging {size} more bytes would pass the {self.max_total_bytes}-byte cap for one "
                f"version (--max-staged-gb)"
            )

    def temp_path(self, version: int, index: int) -> str:
        fd, path = tempfile.mkstemp(prefix=f"v{version}-{index:06d}.", suffix=".part", dir=self.dir)
        os.close(fd)
        return path

    def keep(self, version: int, index: int, temp: str, sha: str, size: int) -> None:
        """Rename a checked temporary file into place (a new inode: a mapped older file is never touched)."""
        path = os.path.join(self.dir, f"v{version}-{index:06d}.bucket")
        old = self.buckets.get(index)
        os.replace(temp, path)
        if old and old[0] != path:
            _unlink(old[0])
        self.buckets[index] = (path, sha, size)

    def reset(self, version: int | None) -> None:
        for path, _, _ in self.buckets.values():
            _unlink(path)
        self.version, self.buckets = version, {}

    def close(self) -> None:
        self.reset(None)
        shutil.rmtree(self.dir, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
