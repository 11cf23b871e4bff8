"""Weight buckets: a flat byte buffer plus a JSON manifest, serialised as safetensors bytes (never pickle).

Imports only torch, safetensors and the standard library, so rollout engines and servers decode buckets
without importing megatron. Manifest: {version, index, count, names, dtypes, shapes, offsets, nbytes, sha256}.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


class BucketError(ValueError):
    """A bucket that fails its checksum or cannot be decoded; the message names the bucket."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sha256(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.numpy().tobytes() if flat.numel() else b"").hexdigest()


@dataclass
class Bucket:
    flat: torch.Tensor  # uint8, all tensors back to back
    manifest: dict

    def tensors(self) -> Iterator[tuple]:
        """(name, tensor) views into the flat buffer."""
        m = self.manifest
        for name, dtype, shape, off, n in zip(m["names"], m["dtypes"], m["shapes"], m["offsets"], m["nbytes"]):
            yield name, self.flat[off: off + n].view(_DTYPES[dtype]).view(shape)

    @property
    def label(self) -> str:
        m = self.manifest
        return f"bucket {m['index'] + 1}/{m['count'] or '?'} of weight version {m['version']}"

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        return save({"flat": self.flat}, metadata={"mgrpo_manifest": json.dumps(self.manifest)})

    @classmethod
    def from_bytes(cls, data: bytes, verify: bool = True) -> "Bucket":
        from safetensors.torch import load

        try:
            header_len = int.from_bytes(data[:8], "little")
            manifest = json.loads(json.loads(data[8: 8 + header_len])["__metadata__"]["mgrpo_manifest"])
            flat = load(data)["flat"]
        except Exception as exc:
            raise BucketError(f"cannot decode weight bucket ({type(exc).__name__}: {exc}); the bytes are "
                              f"truncated or not a bucket") from None
        bucket = cls(flat, manifest)
        if verify:
            bucket.verify()
        return bucket

    def verify(self) -> None:
        got = _sha256(self.flat)
        if got != self.manifest["sha256"]:
            raise BucketError(f"{self.label}: sha256 mismatch (expected {self.manifest['sha256'][:12]}..., got "
                              f"{got[:12]}...); the bucket was corrupted in transit, resend it")


def pack_bucket(items: list, version: int, index: int, count: int = 0, checksum: bool = True) -> Bucket:
    """One bucket from (name, tensor) pairs (copied into a fresh flat buffer); `checksum=False` skips the
    sha256 for transfers that never leave the job's own process group."""
    names, dtypes, shapes, offsets, nbytes = [], [], [], [], []
    total = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        names.append(name)
        dtypes.append(_dtype_name(t.dtype))
        shapes.append(list(t.shape))
        offsets.append(total)
        nbytes.append(n)
        total += n
    flat = torch.empty(total, dtype=torch.uint8)
    for (_, t), off, n in zip(items, offsets, nbytes):
        flat[off: off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    manifest = dict(version=version, index=index, count=count, names=names, dtypes=dtypes, shapes=shapes,
                    offsets=offsets, nbytes=nbytes, sha256=_sha256(flat) if checksum else "")
    return Bucket(flat, manifest)


def make_buckets(named_tensors: Iterable[tuple], bucket_bytes: int, version: int,
                 checksum: bool = True) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most `bucket_bytes` (a larger tensor goes alone).

    `count` in the manifest is 0 (unknown) while streaming; consumers stop when the iterator ends.
    """
    pending, size, index = [], 0, 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if pending and size + n > bucket_bytes:
            yield pack_bucket(pending, version, index, checksum=checksum)
            pending, size, index = [], 0, index + 1
        pending.append((name, t))
        size += n
    if pending:
        yield pack_bucket(pending, version, index, checksum=checksum)
