"""Packing a tensor stream one tensor at a time (`weights/stream_pack.py`): the aligned layout is bit for bit
`pack_bucket`'s (the receivers' checks apply unchanged), the flattened layout is SGLang's (back to back, every
offset a multiple of its item size), buckets stay within their size (a larger tensor alone), two buffers
alternate and are reused."""

import torch

from mgrpo.weights.bucket import DTYPES, pack_bucket
from mgrpo.weights.stream_pack import StreamPacker


def unpack_flattened(flat, meta):
    """What SGLang's `FlattenedTensorBucket.empty(...).reconstruct_tensors()` gives (checked against SGLang itself
    in tests/rollout/test_sglang_wire.py)."""
    out, off = [], 0
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
        n = int(torch.Size(shape).numel()) * DTYPES[dtype].itemsize
        out.append((name, flat[off : off + n].view(DTYPES[dtype]).view(shape)))
        off += n
    return out


def _stream():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(100, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(30, 4, generator=g).t()),  # a strided view
        ("d", torch.randint(0, 5, (9,), generator=g)),
        ("big", torch.randn(300, generator=g)),
        ("e", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("f", torch.randn(5, generator=g)),
    ]


def _pack_all(layout, bucket_bytes=512):
    buffers, out = [None, None], []
    packer = StreamPacker(buffers, bucket_bytes, layout)
    groups, cur = [], []
    for name, t in _stream():
        if not packer.fits(t):
            out.append(packer.take(3))
            groups.append(cur)
            cur = []
        packer.add(name, t)
        cur.append((name, t))
        if layout == "aligned":  # a taken bucket's bytes are copied before the buffer is reused, as a wire would
            out = [b if not hasattr(b, "flat") else type(b)(b.flat.clone(), b.manifest) for b in out]
        else:
            out = [(f.clone(), m) for f, m in out]
    out.append(packer.take(3))
    groups.append(cur)
    return out, groups, buffers


def test_aligned_layout_is_pack_bucket_bit_for_bit():
    buckets, groups, buffers = _pack_all("aligned")
    assert len(buckets) >= 3 and all(b is not None for b in buffers)
    for i, (b, items) in enumerate(zip(buckets, groups)):
        want = pack_bucket(items, 3, i, checksum=False)
        assert b.manifest == want.manifest and torch.equal(b.flat, want.flat)
        assert b.flat.numel() <= 512 or len(items) == 1  # within the size, or one large tensor alone
    assert [n for n, _ in groups[[len(g) == 1 and g[0][0] == "big" for g in groups].index(True)]] == ["big"]


def test_flattened_layout_is_sglangs_and_aligned():
    buckets, groups, _ = _pack_all("flattened")
    for (flat, meta), items in zip(buckets, groups):
        assert meta["names"] == [n for n, _ in items]
        off = 0
        for (_, t), dtype in zip(items, meta["dtypes"]):
            assert off % t.element_size() == 0
            off += t.numel() * t.element_size()
        assert flat.numel() == off  # no padding
        got = dict(unpack_flattened(flat, meta))
        assert all(torch.equal(got[n], t) for n, t in items)


def test_a_tensor_larger_than_a_bucket_goes_alone_from_its_own_memory():
    big = torch.randn(200)
    for layout in ("aligned", "flattened"):
        packer = StreamPacker([None, None], 512, layout)
        packer.add("small", torch.randn(4))
        assert packer.solo(big) and not packer.solo(big[::2]) and not packer.solo(torch.randn(4))
        first = packer.take()
        out = packer.take_solo("big", big)
        flat = out.flat if layout == "aligned" else out[0]
        assert flat.data_ptr() == big.data_ptr() and flat.numel() == 800  # no copy
        if layout == "aligned":
            want = pack_bucket([("big", big)], 0, 1, checksum=False)
            assert out.manifest == want.manifest and torch.equal(out.flat, want.flat)
            assert first.manifest["index"] == 0
        assert packer.buffers[1] is None  # no buffer grew to the big tensor's size
