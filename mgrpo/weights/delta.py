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
{"codec": "sparse_zstd" | "xor_zstd", "dtype", "shape", "count" (changed words), "xxh3": hex}}}` that the bucket
digest covers; a coded tensor is its
compressed bytes as a 1-D uint8 tensor. JSON and safetensors only, never pickle.
"""

from __future__ import annotations

import math
import warnings

import torch

from mgrpo.weights.bucket import DTYPES, BucketError, dtype_name

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer view for the XOR
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


class DeltaSender:
    """The sender's base: the last version it sent of its own tensors, in the wire dtype, in host memory.

    `encode(items)` turns one bucket's (name, tensor) into the wire items and the manifest's delta section,
    updating the base to the new values; `commit(version)` records that the receivers hold `version`;
    `forget()` drops it all (the next push is full)."""

    def __init__(self, level: int = 1, max_fraction: float = 0.9):
        import zstandard

        self.compressor = zstandard.ZstdCompressor(level=level, threads=-1)  # -1: one thread per core
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
        dtype goes XOR-coded when that is smaller; every tensor replaces its base."""
        wire, codec = [], {}
        for name, t in items:
            t = t.detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.contiguous().cpu()
            n = t.numel() * t.element_size()
            old = self.base.get(name)
            same = old is not None and old.shape == t.shape and old.dtype == t.dtype
            coded = None
            if delta and same and n and t.element_size() in _INT:
                x = torch.bitwise_xor(_bits(t), _bits(old))
                pos = torch.nonzero(x).view(-1)
                self.stats["changed"] += pos.numel()
                kind, blob = self._compress(x, pos)
                if len(blob) <= self.max_fraction * n:
                    with warnings.catch_warnings():  # read-only bytes, only sent: no copy
                        warnings.simplefilter("ignore", UserWarning)
                        coded = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
                    codec[name] = {
                        "codec": kind,
                        "dtype": dtype_name(t.dtype),
                        "shape": list(t.shape),
                        "count": pos.numel(),
                        "xxh3": tensor_digest(t),
                    }
            elif delta:
                self.stats["changed"] += t.numel()
            self.stats["elements"] += t.numel()
            self.stats["dense_bytes"] += n
            self.stats["wire_bytes"] += coded.numel() if coded is not None else n
            if same:
                old.copy_(t)
            else:
                self.base[name] = t.clone()
            wire.append((name, coded if coded is not None else t))
        if not delta:
            return wire, None
        return wire, {"base": self.version, "codec": codec}

    def _compress(self, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """(codec, bytes) of one tensor's XOR `x` whose nonzero positions are `pos`: below SPARSE_BELOW of the
        elements changed, the gaps between changed positions (int32) then the changed XOR words, zstd-compressed
        (`sparse_zstd`: zstd reads ~6 bytes per change instead of every byte); else the XOR itself (`xor_zstd`)."""
        if pos.numel() < SPARSE_BELOW * x.numel():
            gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)).to(torch.int32)
            raw = gaps.numpy().tobytes() + x[pos].numpy().tobytes()
            return "sparse_zstd", self.compressor.compress(raw) if pos.numel() else b""
        return "xor_zstd", self.compressor.compress(memoryview(x.view(torch.uint8).numpy()))

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
    the base."""

    def __init__(self):
        import zstandard

        self.decompressor = zstandard.ZstdDecompressor()
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
        try:
            for name, t in tensors:
                old = self.base.get(name)
                if name in codec:
                    self._xor(name, codec[name], t, old, who)
                elif old is None or old.shape != t.shape or old.dtype != t.dtype:
                    raise NeedFull(f"{who}: tensor {name!r} {tuple(t.shape)} {t.dtype} is not in the base")
                else:
                    old.copy_(t)
        except NeedFull:
            self.forget()  # part of it may be applied: nothing of this base is used again
            raise

    def _xor(self, name: str, spec: dict, blob: torch.Tensor, old, who: str) -> None:
        kind, dtype, shape = spec.get("codec"), DTYPES.get(spec.get("dtype")), list(spec.get("shape") or [])
        if kind not in ("xor_zstd", "sparse_zstd") or dtype is None or dtype.itemsize not in _INT:
            raise NeedFull(f"{who}: tensor {name!r} has codec {kind!r} of {spec.get('dtype')!r}")
        if old is None or old.dtype != dtype or list(old.shape) != shape:
            raise NeedFull(f"{who}: tensor {name!r} is not in the base as {shape} {spec.get('dtype')}")
        numel, word = math.prod(shape), _INT[dtype.itemsize]
        count = int(spec.get("count") or 0)
        n = numel * dtype.itemsize if kind == "xor_zstd" else count * (4 + dtype.itemsize)
        try:
            raw = self.decompressor.decompress(memoryview(blob.contiguous().numpy()), max_output_size=n) if n else b""
        except Exception as exc:  # noqa: BLE001 - zstd's own error type
            raise NeedFull(f"{who}: tensor {name!r}: the delta does not decompress ({exc})") from None
        if len(raw) != n:
            raise NeedFull(f"{who}: tensor {name!r}: the delta holds {len(raw)} bytes, {n} expected")
        with warnings.catch_warnings():  # read-only bytes, only read: no copy
            warnings.simplefilter("ignore", UserWarning)
            if kind == "xor_zstd":
                _bits(old).bitwise_xor_(torch.frombuffer(raw, dtype=word))
            elif count:
                gaps = torch.frombuffer(raw, dtype=torch.int32, count=count)
                words = torch.frombuffer(raw, dtype=word, offset=4 * count, count=count)
                pos = gaps.to(torch.int64).cumsum(0) - 1
                if int(gaps.min()) < 1 or int(pos[-1]) >= numel:
                    raise NeedFull(f"{who}: tensor {name!r}: the delta's positions are out of order or range")
                flat = _bits(old)
                flat[pos] = flat[pos] ^ words
        if tensor_digest(old) != spec.get("xxh3"):
            raise NeedFull(f"{who}: tensor {name!r} after the delta does not match its digest; nothing was loaded")

    def set(self, version: int, tensors: dict) -> None:
        self.base, self.version = dict(tensors), version

    def forget(self) -> None:
        self.base, self.version = {}, None
