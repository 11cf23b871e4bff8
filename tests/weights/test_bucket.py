"""The weight-bucket codec: safetensors bytes (no pickle), views back out, and checksums that name the bucket."""

import json
import subprocess
import sys

import pytest
import torch

from mgrpo.weights.bucket import ALIGN, Bucket, BucketError, ManifestCheck, digest, make_buckets, pack_bucket


def tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 32, generator=g)),
        ("b.bias", torch.randn(7, generator=g)),
        ("c.weight", torch.randn(300, 16, generator=g).bfloat16()),
        ("d.scalar", torch.tensor(3.0)),
    ]


def test_round_trip_through_bytes_is_bitwise():
    src = tensors()
    buckets = list(make_buckets(iter(src), bucket_bytes=10_000, version=5))
    assert len(buckets) >= 2, "the size bound splits the stream"
    out = {}
    for b in buckets:
        wire = b.to_bytes()
        header = json.loads(wire[8 : 8 + int.from_bytes(wire[:8], "little")])
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
    code = (
        "import sys; import mgrpo.weights.bucket; "
        "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def odd_then_wide():
    g = torch.Generator().manual_seed(1)
    return [
        ("odd.bf16", torch.randn(7, generator=g).bfloat16()),
        ("w.fp32", torch.randn(5, 3, generator=g)),
        ("i.int64", torch.arange(-4, 5, dtype=torch.int64)),
        ("h.fp16", torch.randn(3, generator=g).half()),
    ]


def test_odd_length_bf16_then_fp32_then_int64_round_trips_aligned():
    src = odd_then_wide()
    bucket = pack_bucket(src, version=1, index=0)
    assert all(off % ALIGN == 0 for off in bucket.manifest["offsets"])
    decoded = Bucket.from_bytes(bucket.to_bytes())
    out = dict(decoded.tensors())
    for name, t in src:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name


def test_make_buckets_counts_alignment_padding():
    src = [(f"t{i}", torch.ones(7, dtype=torch.bfloat16)) for i in range(3)]  # 14 bytes each, 64 apart
    buckets = list(make_buckets(iter(src), bucket_bytes=100, version=0))
    assert [b.manifest["names"] for b in buckets] == [["t0", "t1"], ["t2"]]
    assert all(b.flat.numel() <= 100 for b in buckets)


def test_verify_returns_the_digest_over_payload_and_manifest():
    bucket = pack_bucket(odd_then_wide(), version=3, index=1)
    want = digest(bucket.flat, bucket.manifest)
    assert bucket.manifest["sha256"] == want
    assert Bucket.from_bytes(bucket.to_bytes()).verify() == want


@pytest.mark.parametrize(
    "old,new",
    [
        (b"[5, 3]", b"[3, 5]"),
        (rb"\"w.fp32\"", rb"\"w.fp33\""),
        (rb"\"version\": 3", rb"\"version\": 4"),
        (b"64, 128", b"64, 192"),
    ],
    ids=["shape", "name", "version", "offset"],
)
def test_tampered_manifest_is_a_sha256_mismatch(old, new):
    wire = pack_bucket(odd_then_wide(), version=3, index=1).to_bytes()
    assert wire.count(old) == 1 and len(old) == len(new)
    with pytest.raises(BucketError, match=r"bucket 2/\? of weight version \d: sha256 mismatch"):
        Bucket.from_bytes(wire.replace(old, new))


def test_bucket_without_checksum_is_not_a_mismatch():
    bucket = pack_bucket(odd_then_wide(), version=9, index=0, checksum=False)
    assert bucket.manifest["sha256"] == "" and bucket.verify() is None
    decoded = Bucket.from_bytes(bucket.to_bytes(), verify=True)
    assert decoded.verify() is None
    with pytest.raises(
        BucketError,
        match=r"bucket 1/\? of weight version 9: carries no sha256 but this "
        r"transport requires one; pack it with checksum=True",
    ):
        Bucket.from_bytes(bucket.to_bytes(), require_checksum=True)
    checked = pack_bucket(odd_then_wide(), version=9, index=0)
    assert Bucket.from_bytes(checked.to_bytes(), require_checksum=True).verify() == checked.manifest["sha256"]


def expected_of(items):
    return {n: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in items}


def test_manifest_check_complete_set_passes():
    src = tensors()
    check = ManifestCheck(expected_of(src), optional=["lm_head.weight"])
    buckets = list(make_buckets(iter(src), bucket_bytes=10_000, version=5))
    for b in buckets:
        check.add(Bucket.from_bytes(b.to_bytes()))
    summary = check.finish()
    assert summary == {
        "tensors": len(src),
        "bytes": sum(t.numel() * t.element_size() for _, t in src),
        "buckets": len(buckets),
        "digests": [b.manifest["sha256"] for b in buckets],
    }
    # an optional name may also arrive; a bucket without a digest adds none
    check = ManifestCheck(expected_of(src), optional=["lm_head.weight"])
    check.add(pack_bucket(src + [("lm_head.weight", torch.zeros(2))], 0, 0, checksum=False))
    assert check.finish()["digests"] == [] and check.finish()["tensors"] == len(src) + 1


def _tamper_layout(field, value):
    def go(src):
        b = pack_bucket(src, 7, 1, checksum=False)
        b.manifest[field] = value(b.manifest[field])
        return [b]

    return go


# each case: (how to build the buckets from tensors(), expected-dict change, message that must be raised)
FAILURES = {
    "missing": (lambda src: [pack_bucket(src[:-1], 7, 0)], None, r"1 expected tensor\(s\) never arrived.*'d\.scalar'"),
    "twice": (
        lambda src: [pack_bucket(src, 7, 0), pack_bucket(src[:1], 7, 1)],
        None,
        r"tensor 'a\.weight' arrived twice \(bucket 2/\? of weight version 7, first in bucket 1/\?",
    ),
    "twice_in_one": (lambda src: [pack_bucket(src + src[:1], 7, 0)], None, r"'a\.weight' arrived twice"),
    "unknown": (
        lambda src: [pack_bucket(src + [("x", torch.zeros(1))], 7, 1)],
        None,
        r"HF engine: unknown tensor 'x' \(bucket 2/\? of weight version 7\)",
    ),
    "shape": (
        lambda src: [pack_bucket(src, 7, 0)],
        ("b.bias", ((8,), "float32")),
        r"tensor 'b\.bias' .* arrived as \(7,\) float32, expected \(8,\) float32",
    ),
    "dtype": (
        lambda src: [pack_bucket(src, 7, 0)],
        ("c.weight", ((300, 16), "float32")),
        r"tensor 'c\.weight' .* arrived as \(300, 16\) bfloat16, expected \(300, 16\) float32",
    ),
    "lengths": (_tamper_layout("nbytes", lambda v: v[:-1]), None, "different lengths"),
    "nbytes": (
        _tamper_layout("shapes", lambda v: [[64, 33]] + v[1:]),
        None,
        r"'a\.weight': nbytes 8192 != numel\*itemsize 8448",
    ),
    "misaligned": (_tamper_layout("offsets", lambda v: [v[0], v[1] + 4] + v[2:]), None, "not 64-byte aligned"),
    "outside": (_tamper_layout("offsets", lambda v: v[:-1] + [v[-1] + 64]), None, "inside the"),
    "overlap": (
        _tamper_layout("offsets", lambda v: [v[0], v[0]] + v[2:]),
        None,
        r"tensors '(a\.weight|b\.bias)' and '(a\.weight|b\.bias)' overlap",
    ),
    "sha256": (
        lambda src: [Bucket(pack_bucket(src, 7, 0).flat.clone().fill_(1), pack_bucket(src, 7, 0).manifest)],
        None,
        "sha256 mismatch",
    ),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_manifest_check_each_check_can_fail(case):
    """Negative control: every check really raises on its bad input, naming the tensor and the bucket."""
    build, change, message = FAILURES[case]
    src = tensors()
    expected = expected_of(src)
    if change:
        expected[change[0]] = change[1]
    check = ManifestCheck(expected)
    with pytest.raises(BucketError, match=message) as err:
        for b in build(src):
            check.add(b)
        check.finish()
    assert "HF engine" in str(err.value)
    if case != "missing":
        assert "bucket " in str(err.value)


def test_failed_add_records_nothing():
    src = tensors()
    check = ManifestCheck(expected_of(src))
    with pytest.raises(BucketError, match="unknown tensor 'x'"):
        check.add(pack_bucket(src[:2] + [("x", torch.zeros(1))], 0, 0))
    check.add(pack_bucket(src, 0, 1))  # the first two were not recorded, so not "arrived twice"
    assert check.finish()["tensors"] == len(src)


def test_tampered_shape_is_caught_by_digest_and_by_manifest_check():
    src = tensors()
    wire = pack_bucket(src, version=2, index=0).to_bytes()
    bad = wire.replace(b"[64, 32]", b"[64, 33]")
    assert bad != wire
    with pytest.raises(BucketError, match="sha256 mismatch"):
        Bucket.from_bytes(bad)  # the digest covers the manifest
    decoded = Bucket.from_bytes(bad, verify=False)
    decoded.manifest["sha256"] = ""  # as if sent without a digest: the layout check still catches it
    with pytest.raises(
        BucketError,
        match=r"HF engine: bucket 1/\? of weight version 2 has an inconsistent "
        r"manifest: tensor 'a\.weight': nbytes",
    ):
        ManifestCheck(expected_of(src)).add(decoded)


def test_every_bucket_is_cut_by_one_rule():
    """bucket.cut_buckets is where buckets are cut: packed buckets (64-byte offsets) and view buckets (no
    padding) take their lists from it. Expected lists worked by hand for 40, 80, 20, 400, 12, 12 bytes in 128-byte
    buckets."""
    from mgrpo.weights.bucket import cut_buckets, make_buckets, view_buckets

    sizes = [10, 20, 5, 100, 3, 3]  # float32 elements: 40, 80, 20, 400, 12, 12 bytes
    stream = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    names = lambda lists: [[n for n, _ in items] for items in lists]  # noqa: E731
    aligned = [["t0"], ["t1"], ["t2"], ["t3"], ["t4", "t5"]]  # 40 -> 64+80 > 128, ...; 12 -> 64+12 fits
    packed_views = [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]  # 40+80 fits, +20 does not
    assert names(cut_buckets(stream, 128)) == aligned
    assert names(cut_buckets(stream, 128, align=1)) == packed_views
    assert [b.manifest["names"] for b in make_buckets(stream, 128, version=1)] == aligned
    assert [b.manifest["names"] for b in view_buckets(stream, 128, version=1)] == packed_views
