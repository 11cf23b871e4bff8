"""Weight deltas: send what changed since the version the receiver holds, and get bitwise the weights a full push
would give.

After one RL step at a small LR most bf16 elements do not change (the update is under bf16's rounding step):
measured here on an ~85M model at LR 1e-6, 2.3-4.3% of the elements change per step (../shared/CPU_FACTS.md).
Encodings measured on those steps (docs/weight-sync.md#deltas): raw indices (int32) + values cost 11.5% of the
dense bytes, the XOR of every word zstd-compressed 4.4%, the gaps between changed positions (int32) + the changed
words XORed, zstd-compressed, 3.4% and a third less encode time (zstd reads ~6 bytes per change instead of every
byte). So a tensor travels as `sparse_zstd` where under SPARSE_BELOW of it changed, else `xor_zstd`, or dense where
that is not smaller; zstd level 1 (as small as level 3 here, faster), one thread per core. Peers: NeMo-RL's sparse
delta (BF16 only), verl's delta sync (no PP).

Exactness, both ends (`DeltaSender`, `DeltaBase`):
- a delta names the version it is against (`manifest["delta"]["base"]`); a receiver applies it only on that exact
  base, else `NeedFull`: the sender then pushes the whole version in the same step;
- every delta-coded tensor carries the xxh3_128 of its full bytes after applying, checked by the receiver: a
  mismatch raises `NeedFull` before anything is loaded, and the receiver drops its base (the next push is full);
- the sender's base is updated as it encodes, so after a push it holds exactly the version sent, in the wire dtype:
  the full fallback sends it without driving the export again.

Memory: each side holds one copy of the tensors it sends or receives, in the wire dtype, in host memory (for the
sender its own share of the export; for a rollout server the whole model): `--print-plan` prints the sender's.

Wire: the bucket format of `bucket.py` unchanged, plus a manifest section `"delta": {"base": V, "codec": {name:
{"codec": "sparse_zstd" | "xor_zstd", "dtype", "shape", "count" (changed words), sparse ones also "gap_bytes"
(1, 2 or 4) and "long_gaps" (`narrow_gaps`), "xxh3": hex}}}` that the bucket
digest covers; a coded tensor is its
compressed bytes as a 1-D uint8 tensor. JSON and safetensors only, never pickle.
"""

from __future__ import annotations

import math
import os
import threading
import warnings

import numpy as np
import torch

from mgrpo.weights.bucket import DTYPES, BucketError, dtype_name

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer view for the XOR
CHUNK = 1 << 22  # elements a thread scans at a time in a large tensor (`DeltaSender._changed`)
SPARSE_BELOW = 0.125  # changed fraction under which a tensor goes as positions + changed words (`sparse_zstd`)


NEED_FULL = "needs the whole version"  # in a receiver's refusal of a delta: the sender pushes the version whole


class NeedFull(BucketError):
    """A delta this receiver cannot apply exactly (another base, a digest that does not match): send the whole
    version; nothing was changed."""


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3_128 (hex) of a tensor's bytes: catches corruption and a wrong base, ~12 GB/s here."""
    import xxhash

    t = t.detach().contiguous()
    return xxhash.xxh3_128(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"").hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_INT[t.element_size()])


GAP_WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.int32}  # `gap_bytes`: how a sparse delta's gaps are stored


def default_threads() -> int:
    return min(os.cpu_count() or 1, 8)


def threaded_map(fn, items, threads: int) -> list:
    """[fn(x) for x in items], on up to `threads` threads (numpy's kernels, zstd and xxhash release the GIL), in
    order; a failure is raised once every thread has stopped."""
    items = list(items)
    if threads < 2 or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def narrow_gaps(gaps: np.ndarray) -> tuple:
    """(gaps, long gaps, bytes per gap) of a sparse delta: its gaps in the narrowest width that leaves at most one
    gap in 8 too long for it; each of those is stored as 0 (no real gap is: positions differ) and follows, in
    order, as int32 after the XOR words. At ~4% of the elements changed the gaps are mostly under 256: one byte
    each instead of four, and zstd reads half the bytes (on 3M changes: 0.010 s instead of 0.055 s, 6.0 MB
    instead of 7.4 MB)."""
    count = gaps.size
    for width in (1, 2):
        long = gaps > (1 << 8 * width) - 1
        n_long = int(np.count_nonzero(long))
        if n_long <= count // 8:
            return np.where(long, 0, gaps).astype(GAP_WIDTHS[width]), gaps[long].astype(np.int32), width
    return gaps.astype(np.int32), np.empty(0, np.int32), 4


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.device.type == "cpu" and t.is_contiguous() else t.contiguous().cpu()


class DeltaSender:
    """The sender's base: the last version it sent of its own tensors, in the wire dtype, in host memory.

    `encode(items)` turns one bucket's (name, tensor) into the wire items and the manifest's delta section,
    updating the base to the new values; `commit(version)` records that the receivers hold `version`;
    `forget()` drops it all (the next push is full)."""

    def __init__(self, level: int = 1, max_fraction: float = 0.9, threads: int | None = None):
        self.level, self.local = level, threading.local()  # a zstd compressor per thread: one is not shareable
        self.threads = threads or default_threads()  # tensors are coded side by side (`encode`)
        self.max_fraction = max_fraction  # a coded tensor must be at most this fraction of its dense bytes
        self.base: dict[str, torch.Tensor] = {}
        self.version: int | None = None  # the version `base` holds and the receivers confirmed
        self.stats = dict(dense_bytes=0, wire_bytes=0, changed=0, elements=0)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def reset_stats(self) -> None:
        self.stats = dict(dense_bytes=0, wire_bytes=0, changed=0, elements=0)

    def encode(self, items: list, delta: bool) -> tuple:
        """(wire items, manifest section or None): with `delta`, each tensor the base holds at the same shape and
        dtype goes XOR-coded when that is smaller; every tensor replaces its base. The tensors of a bucket are
        coded on `threads` threads (numpy's kernels and zstd release the GIL): measured on the ~85M model's
        bf16 step at LR 1e-6, 0.25 s on one thread, 0.15-0.17 s on two; 0.26 s with torch's kernels, whose
        OpenMP pools the threads share (docs/weight-sync.md#deltas)."""
        items = [(name, _host(t)) for name, t in items]
        new = {name for name, t in items if not self._same(name, t)}
        coded = threaded_map(lambda item: self._encode_one(*item, delta), items, self.threads)
        wire, codec = [], {}
        for (name, t), (blob, spec, changed) in zip(items, coded):
            n = t.numel() * t.element_size()
            self.stats["changed"] += changed if delta else 0
            self.stats["elements"] += t.numel()
            self.stats["dense_bytes"] += n
            self.stats["wire_bytes"] += blob.numel() if spec is not None else n
            if spec is not None:
                codec[name] = spec
            wire.append((name, blob if spec is not None else t))
        for name, t in items:
            if name in new:
                self.base[name] = t.clone()
        if not delta:
            return wire, None
        return wire, {"base": self.version, "codec": codec}

    def _same(self, name: str, t: torch.Tensor) -> bool:
        old = self.base.get(name)
        return old is not None and old.shape == t.shape and old.dtype == t.dtype

    def _encode_one(self, name: str, t: torch.Tensor, delta: bool) -> tuple:
        """(coded bytes as uint8, its codec spec or None for dense, changed elements) of one tensor; its base
        takes the new values (a new tensor's base is added by `encode`, on one thread)."""
        if not self._same(name, t):
            return t, None, t.numel()
        old, n = self.base[name], t.numel() * t.element_size()
        if not (delta and n and t.element_size() in _INT):
            old.copy_(t)
            return t, None, t.numel()
        a, b = _bits(t).numpy(), _bits(old).numpy()  # numpy: its kernels run on this thread, GIL released
        pos = self._changed(a, b)
        sparse = pos.size < SPARSE_BELOW * a.size
        if sparse:  # only the changed words are XORed, and only they are written into the base
            now = a[pos]
            gaps, long, width = narrow_gaps(np.diff(pos, prepend=-1))
            blob = b""
            if pos.size:
                z = self._compressor().compressobj()
                blob = b"".join(z.compress(x.data) for x in (gaps, now ^ b[pos], long)) + z.flush()
            b[pos] = now
        else:
            blob = self._compressor().compress(np.bitwise_xor(a, b).view(np.uint8).data)
            old.copy_(t)
        if len(blob) > self.max_fraction * n:
            return t, None, pos.size
        with warnings.catch_warnings():  # read-only bytes, only sent: no copy
            warnings.simplefilter("ignore", UserWarning)
            coded = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        spec = {
            "codec": "sparse_zstd" if sparse else "xor_zstd",
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "count": int(pos.size),
            "xxh3": tensor_digest(t),
        }
        if sparse:
            spec.update(gap_bytes=width, long_gaps=int(long.size))
        return coded, spec, pos.size

    def _changed(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Positions (int64) where `a` and `b` differ. numpy, not torch: its compare and `flatnonzero` run on the
        calling thread with the GIL released, twice the rate of torch's one-thread `nonzero` (~85M bf16 words:
        0.095 s against 0.19 s), and side by side with the other tensors' threads (`encode`) without torch's
        OpenMP pool under them. A tensor of more than two CHUNKs is scanned a CHUNK at a time (the mask stays
        small), on `threads` threads (an embedding is half of a small model)."""
        if a.size < 2 * CHUNK:
            return np.flatnonzero(a != b)

        def part(start):
            return np.flatnonzero(a[start : start + CHUNK] != b[start : start + CHUNK]) + start

        return np.concatenate(threaded_map(part, range(0, a.size, CHUNK), self.threads))

    def _compressor(self):
        """zstd at `level`, one per thread (`sparse_zstd`: the gaps between changed positions (`narrow_gaps`) then
        the changed XOR words: zstd reads ~3 bytes per change instead of every byte; `xor_zstd`: the XOR itself)."""
        compressor = getattr(self.local, "compressor", None)
        if compressor is None:
            import zstandard

            compressor = self.local.compressor = zstandard.ZstdCompressor(level=self.level)
        return compressor

    def items(self) -> list:
        """The base as (name, tensor), in the order the tensors were first sent: a full push of the version it
        holds."""
        return list(self.base.items())

    def commit(self, version: int) -> None:
        self.version = version

    def forget(self) -> None:
        self.base.clear()
        self.version = None


class DeltaBase:
    """The receiver's base: the tensors of the version it last loaded, by name, in the wire dtype (writable views
    into whatever store the receiver keeps them in: a rollout server keeps the version's bucket files).

    `check(manifest, version)` raises `NeedFull`, changing nothing, when a bucket is a delta against another base;
    `apply(manifest, tensors)` writes one checked bucket into the base in place (a coded tensor XORed, a dense one
    copied) and checks each result's digest: on a mismatch the base is dropped (`forget`, the next push is full)
    and `NeedFull` raised, so a wrong tensor is never loaded. `set(version, tensors)` makes a loaded full version
    the base. The tensors of a bucket are applied on `threads` threads (numpy and zstd release the GIL; ~85M bf16
    words at 4% changed: 0.10 s on one thread)."""

    def __init__(self, threads: int | None = None):
        self.local = threading.local()  # a zstd decompressor per thread: one is not shareable
        self.threads = threads or default_threads()
        self.base: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def check(self, manifest: dict, version: int, who: str = "receiver") -> None:
        delta = manifest.get("delta")
        if delta is not None and (self.version is None or delta.get("base") != self.version):
            have = "no base" if self.version is None else f"version {self.version}"
            raise NeedFull(
                f"{who}: a delta against version {delta.get('base')} arrived for version {version}; it holds {have}"
            )

    def apply(self, manifest: dict, tensors, version: int, who: str = "receiver") -> None:
        self.check(manifest, version, who)
        codec = (manifest.get("delta") or {}).get("codec") or {}

        def one(item):
            name, t = item
            old = self.base.get(name)
            if name in codec:
                self._xor(name, codec[name], t, old, who)
            elif old is None or old.shape != t.shape or old.dtype != t.dtype:
                raise NeedFull(f"{who}: tensor {name!r} {tuple(t.shape)} {t.dtype} is not in the base")
            else:
                old.copy_(t)

        try:
            threaded_map(one, tensors, self.threads)
        except NeedFull:
            self.forget()  # part of it may be applied: nothing of this base is used again
            raise

    def _xor(self, name: str, spec: dict, blob: torch.Tensor, old, who: str) -> None:
        kind, dtype, shape = spec.get("codec"), DTYPES.get(spec.get("dtype")), list(spec.get("shape") or [])
        if kind not in ("xor_zstd", "sparse_zstd") or dtype is None or dtype.itemsize not in _INT:
            raise NeedFull(f"{who}: tensor {name!r} has codec {kind!r} of {spec.get('dtype')!r}")
        if old is None or old.dtype != dtype or list(old.shape) != shape:
            raise NeedFull(f"{who}: tensor {name!r} is not in the base as {shape} {spec.get('dtype')}")
        numel = math.prod(shape)
        count, width, n_long = int(spec.get("count") or 0), spec.get("gap_bytes", 4), spec.get("long_gaps", 0)
        if width not in GAP_WIDTHS or type(n_long) is not int or not 0 <= n_long <= count:
            raise NeedFull(f"{who}: tensor {name!r} has gap_bytes {width!r}, long_gaps {n_long!r}")
        n = numel * dtype.itemsize if kind == "xor_zstd" else count * (width + dtype.itemsize) + 4 * n_long
        try:
            raw = (
                self._decompressor().decompress(memoryview(blob.contiguous().numpy()), max_output_size=n) if n else b""
            )
        except Exception as exc:  # noqa: BLE001 - zstd's own error type
            raise NeedFull(f"{who}: tensor {name!r}: the delta does not decompress ({exc})") from None
        if len(raw) != n:
            raise NeedFull(f"{who}: tensor {name!r}: the delta holds {len(raw)} bytes, {n} expected")
        flat = _bits(old).numpy()  # numpy, as the sender: one thread, no OpenMP pool
        if kind == "xor_zstd":
            flat ^= np.frombuffer(raw, dtype=flat.dtype)
        elif count:
            gaps = np.frombuffer(raw, dtype=GAP_WIDTHS[width], count=count).astype(np.int64)
            words = np.frombuffer(raw, dtype=flat.dtype, offset=width * count, count=count)
            if n_long:  # the gaps too long for the width: stored as 0, then in order after the words
                zero = np.flatnonzero(gaps == 0)
                if zero.size != n_long:
                    raise NeedFull(f"{who}: tensor {name!r}: {zero.size} long gaps marked, {n_long} sent")
                gaps[zero] = np.frombuffer(raw, dtype=np.int32, offset=n - 4 * n_long)
            pos = np.cumsum(gaps) - 1
            if int(gaps.min()) < 1 or int(pos[-1]) >= numel:
                raise NeedFull(f"{who}: tensor {name!r}: the delta's positions are out of order or range")
            flat[pos] ^= words  # positions strictly increase: each word is XORed once
        if tensor_digest(old) != spec.get("xxh3"):
            raise NeedFull(f"{who}: tensor {name!r} after the delta does not match its digest; nothing was loaded")

    def _decompressor(self):
        decompressor = getattr(self.local, "decompressor", None)
        if decompressor is None:
            import zstandard

            decompressor = self.local.decompressor = zstandard.ZstdDecompressor()
        return decompressor

    def set(self, version: int, tensors: dict) -> None:
        self.base, self.version = dict(tensors), version

    def forget(self) -> None:
        self.base, self.version = {}, None
