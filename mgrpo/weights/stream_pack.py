"""Packing a stage's (name, tensor) stream into flat buckets one tensor at a time, into two reused buffers.

The collective senders (`weights/transports/collective*.py`) used to collect a bucket's worth of full tensors and
then copy them into a flat buffer: a bucket of tensors, the flat buffer being filled and the one on the wire were
alive at once. Here each full tensor is copied into the current buffer as soon as the export makes it and dropped,
so a sender holds the two buffers (the one being filled, the one on the wire), the TP gather of the group in
progress and one parameter's full tensors. A tensor larger than a bucket goes alone, straight from its own memory.

Two layouts: `aligned`, mgrpo's own (`bucket.pack_bucket`: ALIGN-byte offsets, zeroed padding, the manifest of
`Bucket`), and `flattened`, SGLang's `FlattenedTensorBucket` (back to back, no padding: a tensor whose offset would
not be a multiple of its item size starts a new bucket instead).
"""

from __future__ import annotations

import torch

from mgrpo.weights.bucket import ALIGN, Bucket, align_up, dtype_name, fits


class StreamPacker:
    def __init__(self, buffers: list, bucket_bytes: int, layout: str = "aligned"):
        """buffers: a list of two slots (None or uint8 tensors) owned by the caller, reused across updates."""
        if layout not in ("aligned", "flattened"):
            raise ValueError(f"layout {layout!r}: aligned or flattened")
        self.buffers, self.bucket_bytes, self.layout = buffers, bucket_bytes, layout
        self.slot, self.index = 0, 0
        self.items: list = []  # (name, dtype name, shape, offset, nbytes) of the bucket being filled
        self.end = 0

    def _offset(self, t: torch.Tensor) -> int:
        return align_up(self.end) if self.layout == "aligned" else self.end

    def fits(self, t: torch.Tensor) -> bool:
        """Whether `t` goes into the current bucket (an empty bucket takes any tensor, however large)."""
        if not self.items:
            return True
        if self.layout == "flattened" and self.end % t.element_size():
            return False
        return fits(self.end, t.numel() * t.element_size(), self.bucket_bytes, ALIGN if self.layout == "aligned" else 1)

    def add(self, name: str, t: torch.Tensor) -> None:
        """Copy `t` into the current bucket (call `take()` first when `fits(t)` is False: the buffer `t` would go
        into next may still be on the wire until the caller says otherwise)."""
        n = t.numel() * t.element_size()
        off = self._offset(t)
        buf = self.buffers[self.slot]
        if buf is None or buf.numel() < off + n:
            grown = torch.empty(max(off + n, self.bucket_bytes), dtype=torch.uint8)
            if buf is not None and self.end:
                grown[: self.end].copy_(buf[: self.end])
            self.buffers[self.slot] = buf = grown
        if off > self.end:
            buf[self.end : off].zero_()  # padding is zeroed, so equal tensors give equal digests
        dst = buf[off : off + n]
        if t.is_contiguous():
            dst.copy_(t.reshape(-1).view(torch.uint8))
        else:  # a strided view (a TP gather's rows): copied without a contiguous temporary
            dst.view(t.dtype).view(t.shape).copy_(t)
        self.items.append((name, dtype_name(t.dtype), list(t.shape), off, n))
        self.end = off + n

    def solo(self, t: torch.Tensor) -> bool:
        """Whether `t` goes as a bucket of its own, straight from its memory: larger than a bucket and contiguous
        (copying it into a buffer would grow that buffer to its size for good)."""
        return t.numel() * t.element_size() > self.bucket_bytes and t.is_contiguous()

    def take_solo(self, name: str, t: torch.Tensor, version: int = 0):
        """A bucket of `t` alone whose bytes are `t`'s own (no copy; keep the bucket alive until it is sent). Call
        `take()` first if the current bucket holds anything."""
        assert not self.items, "take() the current bucket first"
        flat = t.detach().reshape(-1).view(torch.uint8)
        meta = {"names": [name], "dtypes": [dtype_name(t.dtype)], "shapes": [list(t.shape)]}
        self.index += 1
        if self.layout == "flattened":
            return flat, meta
        return Bucket(
            flat,
            dict(version=version, index=self.index - 1, count=0, offsets=[0], nbytes=[flat.numel()], sha256="", **meta),
        )

    def __len__(self) -> int:
        return len(self.items)

    def take(self, version: int = 0):
        """The bucket filled so far and the switch to the other buffer: a `Bucket` (aligned) or (flat, {names,
        dtypes, shapes}) (flattened). The returned tensor is valid until the bucket after next is begun."""
        flat = self.buffers[self.slot][: self.end]
        names, dtypes, shapes, offsets, nbytes = (
            (list(x) for x in zip(*self.items)) if self.items else ([], [], [], [], [])
        )
        if self.layout == "aligned":
            out = Bucket(
                flat,
                dict(
                    version=version,
                    index=self.index,
                    count=0,
                    names=names,
                    dtypes=dtypes,
                    shapes=shapes,
                    offsets=offsets,
                    nbytes=nbytes,
                    sha256="",
                ),
            )
        else:
            out = (flat, {"names": names, "dtypes": dtypes, "shapes": shapes})
        self.items, self.end, self.slot, self.index = [], 0, 1 - self.slot, self.index + 1
        return out


def pack_stream(named_tensors, packer: StreamPacker, version: int = 0):
    """The buckets of a (name, tensor) stream, each yielded as soon as it is complete. The caller must be done with
    the bucket before last when it asks for the next one (its buffer is then filled again)."""
    for name, t in named_tensors:
        if (packer.solo(t) or not packer.fits(t)) and len(packer):
            yield packer.take(version)
        if packer.solo(t):
            yield packer.take_solo(name, t, version)
        else:
            packer.add(name, t)
    if len(packer):
        yield packer.take(version)
