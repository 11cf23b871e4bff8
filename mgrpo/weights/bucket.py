"""Weight buckets: the one format every transport moves (and this module defines and documents, once).

Imports only torch, safetensors and the standard library, so rollout engines and servers decode buckets
without importing megatron. Public API: `Bucket`, `BucketError`, `ManifestCheck`, `pack_bucket`,
`make_buckets`, `view_buckets`, `bucket_header`, `parse_bucket_header`, `read_bucket`, `digest`, `Digest`,
`align_up`, `dtype_name`, `ALIGN`, `DTYPES`.

Wire format of one bucket (what `Bucket.to_bytes` writes, `bucket_header` + payload streams, and
`read_bucket` / `Bucket.from_bytes` read; never pickle):

    bytes 0..8       n: the safetensors header length, little endian (header padded with spaces to 8 bytes)
    bytes 8..8+n     JSON: {"__metadata__": {"mgrpo_manifest": "<manifest as JSON>"},
                            "flat": {"dtype": "U8", "shape": [P], "data_offsets": [0, P]}}
    then P bytes     the payload: each tensor's bytes at its manifest offset, every offset a multiple of ALIGN
                     (64) bytes, zero padding between, so any dtype views straight out of the flat buffer
    manifest         {version, index, count (0 while streaming), names, dtypes, shapes, offsets, nbytes, sha256}

Digest (`digest`, or `Digest` fed chunk by chunk): hex sha256 of P as 8 bytes little endian, the payload, then
the manifest without its `sha256` field as canonical JSON (sorted keys, no spaces). Covering the manifest
catches a changed shape, name, offset or version, not only a flipped payload byte; the length prefix keeps the
two parts apart. A bucket packed with checksum=False carries sha256 "" (in-process and trusted local transfers);
the HTTP transport sends the digest as a trailer after the body instead (`transports/http_buckets.py`).

`ManifestCheck` is the receiver's completeness check: every expected tensor arrives exactly once, with the
expected shape and dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

ALIGN = 64  # bytes; a multiple of every itemsize (and of a cache line), so views never land misaligned
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_FIELDS = ("names", "dtypes", "shapes", "offsets", "nbytes")


class BucketError(ValueError):
    """A bucket that fails its checksum, cannot be decoded or is not what the receiver expects; the message
    names the bucket."""


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the manifest names it ("float32", "bfloat16", ...)."""
    return str(dtype).replace("torch.", "")


def align_up(n: int) -> int:
    """`n` rounded up to the next multiple of ALIGN: where the next tensor of a bucket starts."""
    return -(-n // ALIGN) * ALIGN


def canonical_manifest(manifest: dict) -> bytes:
    """The manifest as the digest covers it: without `sha256`, sorted keys, no spaces."""
    m = {k: v for k, v in manifest.items() if k != "sha256"}
    return json.dumps(m, sort_keys=True, separators=(",", ":")).encode()


DIGEST_HEX = {"sha256": 64, "xxh3_128": 32}  # algorithm -> hex digits: sha256 in manifests, either over HTTP


class Digest:
    """The bucket digest computed as the payload streams by (a sender hashing what it sends, a receiver what
    arrives): `Digest(payload_len, algo)`, `update(chunk)` for each payload chunk in order, `finish(manifest)`.
    `sha256` (cryptographic, ~1.2-1.7 GB/s here) or `xxh3_128` (xxhash's XXH3, 128-bit, ~12 GB/s here: catches
    corruption, not tampering, which TLS and the token guard against)."""

    def __init__(self, payload_len: int, algo: str = "sha256"):
        if algo == "sha256":
            self._h = hashlib.sha256()
        elif algo == "xxh3_128":
            import xxhash

            self._h = xxhash.xxh3_128()
        else:
            raise BucketError(f"unknown digest {algo!r}; use one of {', '.join(DIGEST_HEX)}")
        self._h.update(int(payload_len).to_bytes(8, "little"))

    def update(self, chunk) -> None:
        self._h.update(chunk)  # hashlib drops the GIL on large buffers

    def finish(self, manifest: dict) -> str:
        self._h.update(canonical_manifest(manifest))
        return self._h.hexdigest()


def digest(flat: torch.Tensor, manifest: dict) -> str:
    """Hex sha256 of a whole bucket (see the module docstring for what it covers)."""
    d = Digest(flat.numel())
    if flat.numel():
        d.update(memoryview(flat.contiguous().numpy()))  # no copy
    return d.finish(manifest)


@dataclass
class Bucket:
    flat: torch.Tensor  # uint8, each tensor at an ALIGN-byte offset, zero padding between
    manifest: dict
    # digest the last verify() checked, so ManifestCheck.add does not hash a verified bucket twice
    verified: str | None = field(default=None, repr=False, compare=False)

    def tensors(self) -> Iterator[tuple]:
        """(name, tensor) views into the flat buffer."""
        m = self.manifest
        for name, dtype, shape, off, n in zip(*(m[k] for k in _FIELDS)):
            yield name, self.flat[off : off + n].view(DTYPES[dtype]).view(shape)

    @property
    def label(self) -> str:
        m = self.manifest
        return f"bucket {m.get('index', -1) + 1}/{m.get('count') or '?'} of weight version {m.get('version')}"

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        return save({"flat": self.flat}, metadata={"mgrpo_manifest": json.dumps(self.manifest)})

    @classmethod
    def from_bytes(cls, data: bytes, verify: bool = True, require_checksum: bool = False) -> "Bucket":
        """Decode a bucket. `verify` checks the sha256 when the bucket carries one (a bucket packed with
        checksum=False is accepted); `require_checksum` rejects a bucket without one, for transports that
        leave the job (HTTP, shared files) where an unchecked bucket must not be loaded."""
        from safetensors.torch import load

        try:
            header_len = int.from_bytes(data[:8], "little")
            manifest = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["mgrpo_manifest"])
            flat = load(data)["flat"]
            assert isinstance(manifest, dict), "manifest is not a JSON object"
        except Exception as exc:
            raise BucketError(
                f"cannot decode weight bucket ({type(exc).__name__}: {exc}); the bytes are truncated or not a bucket"
            ) from None
        bucket = cls(flat, manifest)
        if require_checksum and not manifest.get("sha256"):
            raise BucketError(
                f"{bucket.label}: carries no sha256 but this transport requires one; pack it with checksum=True"
            )
        if verify:
            bucket.verify()
        return bucket

    def verify(self) -> str | None:
        """Check the sha256 over payload and manifest; return the hex digest checked (a receiver echoes it in
        its reply), or None when the bucket carries none (packed with checksum=False: nothing to check)."""
        want = self.manifest.get("sha256") or ""
        if not want:
            return None
        got = digest(self.flat, self.manifest)
        if got != want:
            raise BucketError(
                f"{self.label}: sha256 mismatch (expected {want[:12]}..., got {got[:12]}...); the "
                f"bucket or its manifest was corrupted in transit, resend it"
            )
        self.verified = got
        return got


def pack_bucket(
    items: list, version: int, index: int, count: int = 0, checksum: bool = True, out: torch.Tensor | None = None
) -> Bucket:
    """One bucket from (name, tensor) pairs (copied into a fresh flat buffer at ALIGN-byte offsets, or into the
    front of `out` when it is large enough: a reused buffer costs no page faults); `checksum=False` skips the sha256
    for transfers that never leave the job's own process group."""
    names, dtypes, shapes, offsets, nbytes = [], [], [], [], []
    total = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
        offsets.append(align_up(total))
        nbytes.append(n)
        total = offsets[-1] + n
    flat = out[:total] if out is not None and out.numel() >= total else torch.empty(total, dtype=torch.uint8)
    for (_, t), off, n, end in zip(items, offsets, nbytes, offsets[1:] + [total]):
        flat[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        flat[off + n : end].zero_()  # padding is zeroed, so equal tensors give equal digests
    manifest = dict(
        version=version,
        index=index,
        count=count,
        names=names,
        dtypes=dtypes,
        shapes=shapes,
        offsets=offsets,
        nbytes=nbytes,
        sha256="",
    )
    if checksum:
        manifest["sha256"] = digest(flat, manifest)
    return Bucket(flat, manifest)


def fits(size: int, nbytes: int, bucket_bytes: int, align: int = ALIGN) -> bool:
    """Whether a tensor of `nbytes` joins a bucket already holding `size` bytes: its offset is `size` rounded up
    to `align`, and the bucket may not pass `bucket_bytes` (an empty bucket takes any tensor, however large)."""
    return size == 0 or -(-size // align) * align + nbytes <= bucket_bytes


def cut_buckets(named_tensors: Iterable[tuple], bucket_bytes: int, align: int = ALIGN) -> Iterator[list]:
    """Where every weight bucket is cut: a (name, tensor) stream into lists of consecutive tensors that `fits`
    `bucket_bytes` with each offset aligned to `align` (ALIGN for packed payloads, 1 for views). The packed and
    view buckets here, the export's rank-to-rank groups (export.py) and the HTTP sender take their lists from
    this function; the packers that copy as they go (stream_pack.py, transports/shared_memory.py) ask `fits`."""
    pending, size = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if not fits(size, n, bucket_bytes, align):
            yield pending
            pending, size = [], 0
        pending.append((name, t))
        size = -(-size // align) * align + n
    if pending:
        yield pending


def make_buckets(
    named_tensors: Iterable[tuple], bucket_bytes: int, version: int, checksum: bool = True
) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most `bucket_bytes` flat bytes, alignment padding
    included (a larger tensor goes alone).

    `count` in the manifest is 0 (unknown) while streaming; consumers stop when the iterator ends.
    """
    for index, items in enumerate(cut_buckets(named_tensors, bucket_bytes)):
        yield pack_bucket(items, version, index, checksum=checksum)


def bucket_header(items: list, version: int, index: int, extra: dict | None = None) -> tuple:
    """(safetensors header bytes, payload length P, manifest) for (name, tensor) views `items`, without building
    the payload: a sender streams the tensors after the header (zero padding to each ALIGN offset). The manifest
    carries sha256 "": a streaming sender computes the digest as it sends (`Digest`). `extra`: more manifest
    fields (a delta's section, `delta.py`), covered by the digest like the rest."""
    offsets, nbytes, total = [], [], 0
    for _, t in items:
        offsets.append(align_up(total))
        nbytes.append(t.numel() * t.element_size())
        total = offsets[-1] + nbytes[-1]
    manifest = dict(
        version=version,
        index=index,
        count=0,
        names=[n for n, _ in items],
        dtypes=[dtype_name(t.dtype) for _, t in items],
        shapes=[list(t.shape) for _, t in items],
        offsets=offsets,
        nbytes=nbytes,
        sha256="",
        **(extra or {}),
    )
    header = json.dumps(
        {
            "__metadata__": {"mgrpo_manifest": json.dumps(manifest)},
            "flat": {"dtype": "U8", "shape": [total], "data_offsets": [0, total]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header, total, manifest


def parse_bucket_header(buf) -> tuple:
    """(header length n, manifest, payload start, payload end) from a bucket's first 8 + n bytes: JSON only,
    never unpickled; raises BucketError when they are not a bucket's."""
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(bytes(buf[8 : 8 + n]))
        manifest = json.loads(header["__metadata__"]["mgrpo_manifest"])
        start, end = header["flat"]["data_offsets"]
        assert header["flat"]["dtype"] == "U8" and 0 <= start <= end, "not one flat uint8 tensor"
    except Exception as exc:
        raise BucketError(
            f"cannot decode weight bucket ({type(exc).__name__}: {exc}); the bytes are truncated or not a bucket"
        ) from None
    return n, manifest, start, end


def read_bucket(buf) -> Bucket:
    """A Bucket whose flat payload is a view into `buf` (e.g. a writable mmap of a staged file), no copy; the
    digest is not checked here (a receiver that hashed the bytes as they arrived sets `verified`)."""
    n, manifest, start, end = parse_bucket_header(buf)
    if 8 + n + end != len(buf):
        raise BucketError(
            f"cannot decode weight bucket: {len(buf)} bytes, its header says {8 + n + end}; the bytes are truncated"
        )
    flat = (
        torch.frombuffer(buf, dtype=torch.uint8, offset=8 + n + start, count=end - start)
        if end > start
        else torch.empty(0, dtype=torch.uint8)
    )
    return Bucket(flat, manifest)


@dataclass
class ViewBucket:
    """In-process bucket: the exported tensors themselves, no flat copy (the engine copies each tensor once,
    into its own parameter). Same manifest as `Bucket` without offsets; nothing to checksum in memory."""

    items: list  # (name, tensor)
    manifest: dict
    verified: str | None = field(default=None, repr=False, compare=False)
    label = Bucket.label

    def tensors(self) -> Iterator[tuple]:
        yield from self.items

    def verify(self) -> None:
        return None


def view_buckets(named_tensors: Iterable[tuple], bucket_bytes: int, version: int) -> Iterator[ViewBucket]:
    """Group a (name, tensor) stream into ViewBuckets of about `bucket_bytes`, holding references only."""

    def emit(pending: list, index: int) -> ViewBucket:
        m = dict(
            version=version,
            index=index,
            count=0,
            names=[n for n, _ in pending],
            dtypes=[dtype_name(t.dtype) for _, t in pending],
            shapes=[list(t.shape) for _, t in pending],
            offsets=None,
            nbytes=[t.numel() * t.element_size() for _, t in pending],
            sha256="",
        )
        return ViewBucket(list(pending), m)

    for index, items in enumerate(cut_buckets(named_tensors, bucket_bytes, align=1)):
        yield emit(items, index)


def _views_problem(bucket: ViewBucket) -> str | None:
    m = bucket.manifest
    if [n for n, _ in bucket.items] != m.get("names"):
        return "the manifest's names are not the tensors it holds"
    for (name, t), dtype, shape in zip(bucket.items, m["dtypes"], m["shapes"]):
        if dtype_name(t.dtype) != dtype or list(t.shape) != list(shape):
            return f"tensor {name!r} is {tuple(t.shape)} {dtype_name(t.dtype)}, the manifest says {shape} {dtype}"
    return None


def _layout_problem(bucket) -> str | None:
    """Why the manifest does not describe its flat buffer, or None: checked before any view is taken, so a
    bad manifest fails with a message instead of a view error or a silent overlap."""
    if isinstance(bucket, ViewBucket):
        return _views_problem(bucket)
    m, size = bucket.manifest, bucket.flat.numel()
    cols = [m.get(k) for k in _FIELDS]
    if not all(isinstance(c, list) for c in cols) or len({len(c) for c in cols}) != 1:
        return "names/dtypes/shapes/offsets/nbytes are missing or of different lengths"
    spans = []
    for name, dtype, shape, off, n in zip(*cols):
        if dtype not in DTYPES:
            return f"tensor {name!r} has unsupported dtype {dtype!r}"
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            return f"tensor {name!r} has a malformed shape {shape!r}"
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if n != want:
            return f"tensor {name!r}: nbytes {n} != numel*itemsize {want} of shape {shape} {dtype}"
        if not isinstance(off, int) or off < 0 or off % ALIGN or off + n > size:
            return f"tensor {name!r}: offset {off} is not {ALIGN}-byte aligned inside the {size}-byte buffer"
        spans.append((off, off + n, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            return f"tensors {a!r} and {b!r} overlap"
    return None


class ManifestCheck:
    """Receiver-side completeness check (as NeMo-RL's `require_complete`): every expected tensor arrives
    exactly once per weight version with the expected shape and dtype, and nothing unknown arrives. Without it
    a renamed or dropped tensor leaves the engine silently serving stale weights.

    `expected` maps name -> (shape, dtype name as in the manifest, e.g. "bfloat16"); `optional` names may
    arrive or not (e.g. lm_head.weight of a tied model) and, unless also in `expected`, are not shape-checked.
    """

    def __init__(self, expected: dict, optional: Iterable[str] = (), receiver: str = "HF engine"):
        self.expected = {name: (tuple(shape), dtype) for name, (shape, dtype) in expected.items()}
        self.optional, self.receiver = set(optional), receiver
        self.seen: dict[str, str] = {}  # name -> label of the bucket it came in
        self.nbytes, self.buckets, self.digests = 0, 0, []

    def add(self, bucket: Bucket) -> None:
        """Check one bucket as it arrives (sha256 if it carries one and verify() has not passed it yet, then
        layout, names, shapes, dtypes); raises BucketError at the first problem and records nothing from a
        bucket that fails."""
        label, who = bucket.label, self.receiver
        m = bucket.manifest
        sha = m.get("sha256") or None
        if sha and bucket.verified != sha:
            try:
                bucket.verify()
            except BucketError as exc:
                raise BucketError(f"{who}: {exc}") from None
        problem = _layout_problem(bucket)
        if problem:
            raise BucketError(
                f"{who}: {label} has an inconsistent manifest: {problem}; the sender packed it "
                f"wrongly or it was altered, resend it"
            )
        here, coded = {}, (m.get("delta") or {}).get("codec") or {}
        for name, dtype, shape in zip(m["names"], m["dtypes"], m["shapes"]):
            if name in coded:  # a delta-coded tensor (`delta.py`) is checked as the tensor it decodes to
                dtype, shape = coded[name].get("dtype"), coded[name].get("shape") or []
            if name in self.seen or name in here:
                raise BucketError(
                    f"{who}: tensor {name!r} arrived twice ({label}, first in "
                    f"{self.seen.get(name, label)}); send each tensor once per weight version"
                )
            if name not in self.expected and name not in self.optional:
                raise BucketError(
                    f"{who}: unknown tensor {name!r} ({label}); the sender's names do not match "
                    f"this model, fix the name mapping"
                )
            if name in self.expected:
                want_shape, want_dtype = self.expected[name]
                if tuple(shape) != want_shape or dtype != want_dtype:
                    raise BucketError(
                        f"{who}: tensor {name!r} ({label}) arrived as {tuple(shape)} {dtype}, "
                        f"expected {want_shape} {want_dtype}; sender and receiver are configured "
                        f"for different models"
                    )
            here[name] = label
        self.seen.update(here)
        self.nbytes += sum(m["nbytes"])
        self.buckets += 1
        if sha:
            self.digests.append(sha)

    def finish(self) -> dict:
        """Raise if an expected (non-optional) tensor never arrived; else a summary a receiver can reply with:
        {"tensors", "bytes", "buckets", "digests" (of each bucket that carried one)}."""
        missing = [n for n in self.expected if n not in self.seen and n not in self.optional]
        if missing:
            raise BucketError(
                f"{self.receiver}: {len(missing)} expected tensor(s) never arrived, e.g. "
                f"{', '.join(map(repr, missing[:5]))}; the sender skipped them, so the update "
                f"is incomplete and must be resent"
            )
        return {"tensors": len(self.seen), "bytes": self.nbytes, "buckets": self.buckets, "digests": list(self.digests)}
