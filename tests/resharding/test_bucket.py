"""The weight-bucket codec: safetensors bytes (no pickle), views back out, and checksums that name the bucket."""
import json
import subprocess
import sys

import pytest
import torch

from mgrpo.resharding.bucket import Bucket, BucketError, make_buckets


def tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(64, 32, generator=g)), ("b.bias", torch.randn(7, generator=g)),
            ("c.weight", torch.randn(300, 16, generator=g).bfloat16()), ("d.scalar", torch.tensor(3.0))]


def test_round_trip_through_bytes_is_bitwise():
    src = tensors()
    buckets = list(make_buckets(iter(src), bucket_bytes=10_000, version=5))
    assert len(buckets) >= 2, "the size bound splits the stream"
    out = {}
    for b in buckets:
        wire = b.to_bytes()
        header = json.loads(wire[8: 8 + int.from_bytes(wire[:8], "little")])
        assert set(header) == {"flat", "__metadata__"}, "plain safetensors: one uint8 tensor plus metadata"
        decoded = Bucket.from_bytes(wire)
        assert decoded.manifest["version"] == 5
        out.update(decoded.tensors())
    assert list(out) == [n for n, _ in src]
    for name, t in src:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    # views share the flat buffer, no copies
    b = Bucket.from_bytes(buckets[0].to_bytes())
    name, view = next(b.tensors())
    assert view.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()


def test_checksum_mismatch_names_the_bucket():
    bucket = next(make_buckets(iter(tensors()), bucket_bytes=1 << 20, version=9))
    wire = bytearray(bucket.to_bytes())
    wire[-5] ^= 0xFF  # flip a byte of the payload
    with pytest.raises(BucketError, match=r"bucket 1/\? of weight version 9: sha256 mismatch"):
        Bucket.from_bytes(bytes(wire))
    with pytest.raises(BucketError, match="truncated or not a bucket"):
        Bucket.from_bytes(bytes(wire[:20]))


def test_codec_imports_without_megatron():
    code = ("import sys; import mgrpo.resharding.bucket; "
            "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
