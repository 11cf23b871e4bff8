"""The HTTP bucket body and the server's streaming check, without a server: the digest computed while sending and
while receiving (any chunking) equals `mgrpo.weights.bucket.digest` over the same bucket packed in memory; a
flipped byte, a changed manifest, a cut trailer are each refused."""

import random

import pytest
import torch

from mgrpo.weights.bucket import BucketError, bucket_header, pack_bucket, read_bucket
from mgrpo.weights.transports.http_buckets import TRAILER, StreamCheck, bucket_body


def items():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(37, 5, generator=g)),
        ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(4, 9, generator=g).t()),
        ("empty", torch.zeros(0)),
    ]


def body(version=3, index=1):
    tensors = items()
    header, total, manifest = bucket_header(tensors, version, index)
    out = {}
    data = b"".join(bytes(c) for c in bucket_body(tensors, header, total, manifest, out))
    assert len(data) == len(header) + total + TRAILER
    return data, out["digest"]


def receive(data: bytes, seed: int) -> tuple:
    check, rng, pos, kept = StreamCheck(len(data)), random.Random(seed), 0, bytearray()
    while pos < len(data):
        n = rng.choice([1, 3, 8, 13, 64, 500, 4096])
        kept += check.feed(data[pos : pos + n])
        pos += n
    return check.finish(), bytes(kept)


@pytest.mark.parametrize("seed", range(5))
def test_digest_while_streaming_equals_the_packed_buckets(seed):
    data, sent = body()
    reference = pack_bucket([(n, t.contiguous()) for n, t in items()], version=3, index=1)
    assert sent == reference.manifest["sha256"]  # independent: hashed from one packed tensor in memory
    got, staged = receive(data, seed)
    assert got == sent
    bucket = read_bucket(bytearray(staged))
    for (name, want), (got_name, tensor) in zip(items(), bucket.tensors()):
        assert name == got_name and torch.equal(tensor, want)


def test_a_flipped_payload_byte_is_refused():
    data, _ = body()
    bad = bytearray(data)
    bad[len(data) - TRAILER - 9] ^= 0x01
    with pytest.raises(BucketError, match="sha256 mismatch"):
        receive(bytes(bad), 0)


def test_a_changed_manifest_is_refused():
    data, _ = body()
    bad = data.replace(b"a.weight", b"x.weight", 1)  # same length: only the hash can tell
    assert bad != data
    with pytest.raises(BucketError, match="sha256 mismatch"):
        receive(bad, 1)


def test_a_cut_or_garbled_body_is_refused():
    data, _ = body()
    with pytest.raises(BucketError, match="header says"):
        receive(data[:-1], 0)  # one byte short: the header no longer adds up
    with pytest.raises(BucketError, match="cannot decode"):
        receive(b"\x10" + bytes(7) + b"not json" * 2 + bytes(200), 0)


def test_xxh3_trailer_equals_an_independent_xxh3_and_catches_a_flip():
    """The fast digest (rollout.remote.checksum xxh3_128): xxhash's own XXH3-128 over length, payload and the
    canonical manifest, computed here without the Digest class; any chunking; a flipped byte is refused."""
    import json

    import xxhash

    tensors = items()
    header, total, manifest = bucket_header(tensors, 3, 1)
    out = {}
    data = b"".join(bytes(c) for c in bucket_body(tensors, header, total, manifest, out, algo="xxh3_128"))
    assert len(data) == len(header) + total + 32
    payload = data[len(header) : len(header) + total]
    canon = json.dumps({k: v for k, v in manifest.items() if k != "sha256"}, sort_keys=True, separators=(",", ":"))
    assert out["digest"] == xxhash.xxh3_128(total.to_bytes(8, "little") + payload + canon.encode()).hexdigest()
    for seed in range(3):
        check, rng, pos = StreamCheck(len(data), "xxh3_128"), random.Random(seed), 0
        while pos < len(data):
            n = rng.choice([1, 7, 64, 4096])
            check.feed(data[pos : pos + n])
            pos += n
        assert check.finish() == out["digest"]
    bad = bytearray(data)
    bad[len(header) + 5] ^= 0x01
    check = StreamCheck(len(bad), "xxh3_128")
    check.feed(bytes(bad))
    with pytest.raises(BucketError, match="xxh3_128 mismatch"):
        check.finish()
    with pytest.raises(BucketError, match="unknown digest"):
        StreamCheck(len(data), "md5")
