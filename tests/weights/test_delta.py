"""Weight deltas through the bucket wire format, without a server: after 5 steps of real optimizer updates (AdamW on
an LM loss, fp32 master, bf16 and fp32 wire dtypes) the receiver's tensors are bitwise the sender's; a delta against
another base is refused with NeedFull and leaves the base as it was; a receiver base that differs from the
sender's, or a delta that does not decompress, is refused with NeedFull and the receiver drops its base (the next
push is full). Negative control: with the per-tensor digest check switched off, the differing base gives wrong
weights (the check is what catches it). A sparse delta's gaps take the narrowest width (1, 2 or 4 bytes, the few
long ones kept aside) and apply bitwise at each; a long gap that points past the end, or marks that do not match
the long gaps sent, are refused (negative control: the same bytes unedited apply)."""

import pytest
import torch

from mgrpo.weights import delta as delta_mod
from mgrpo.weights.bucket import bucket_header, read_bucket
from mgrpo.weights.delta import DeltaBase, DeltaSender, NeedFull
from mgrpo.weights.transports.http_buckets import StreamCheck, bucket_body


def trained_versions(dtype, steps=6, lr=1e-3):
    """(name, tensor) per version of a small LM trained with AdamW on next-token loss, cast to `dtype`."""
    torch.manual_seed(0)
    vocab, dim = 64, 32
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim), torch.nn.Linear(dim, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.randint(0, vocab, (8, 17))
    out = []
    for _ in range(steps):
        out.append([(n, p.detach().to(dtype).clone()) for n, p in model.named_parameters()])
        loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, vocab), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def over_the_wire(items, extra, version=1, index=0):
    """The bytes a server stages for one bucket (header, payload, trailer checked), read back."""
    header, total, manifest = bucket_header(items, version, index, extra)
    data = b"".join(bytes(c) for c in bucket_body(items, header, total, manifest, {}, "xxh3_128"))
    check, staged = StreamCheck(len(data), "xxh3_128"), b""
    staged = check.feed(data)
    check.finish()
    return read_bucket(bytearray(staged))


def push(sender, receiver, items, version, delta=True):
    wire, section = sender.encode(items, delta=delta)
    bucket = over_the_wire(wire, {"delta": section} if section is not None else None, version)
    if section is None:
        receiver.set(version, {n: t.clone() for n, t in bucket.tensors()})
    else:
        receiver.apply(bucket.manifest, bucket.tensors(), version)
        receiver.version = version
    sender.commit(version)
    return receiver.base


@pytest.mark.parametrize(
    "dtype, lr, codec",
    [(torch.bfloat16, 1e-3, "xor_zstd"), (torch.float32, 1e-3, "xor_zstd"), (torch.bfloat16, 1e-5, "sparse_zstd")],
)
def test_five_delta_pushes_equal_the_sender_bitwise(dtype, lr, codec):
    versions = trained_versions(dtype, lr=lr)
    sender, receiver = DeltaSender(), DeltaBase()
    push(sender, receiver, versions[0], 0, delta=False)
    fractions, kinds = [], set()
    for v, items in enumerate(versions[1:], start=1):
        kinds |= {spec["codec"] for spec in sender.encode(items, delta=True)[1]["codec"].values()}
        sender.base = {n: t.clone() for n, t in versions[v - 1]}  # undo the probe: the base is version v - 1 again
        sender.reset_stats()
        got = push(sender, receiver, items, v)
        for name, want in items:
            assert got[name].dtype == want.dtype and torch.equal(got[name].view(torch.uint8), want.view(torch.uint8))
        fractions.append(sender.stats["wire_bytes"] / sender.stats["dense_bytes"])
    print(f"{dtype} LR {lr}: wire bytes / dense per step {[round(f, 3) for f in fractions]}, codecs {kinds}")
    assert all(f < 1.0 for f in fractions) and codec in kinds


def test_a_delta_against_another_base_is_refused_and_changes_nothing():
    versions = trained_versions(torch.bfloat16, steps=3)
    sender, receiver = DeltaSender(), DeltaBase()
    push(sender, receiver, versions[0], 0, delta=False)
    sender.commit(7)  # the sender believes the receiver holds version 7
    wire, section = sender.encode(versions[1], delta=True)
    bucket = over_the_wire(wire, {"delta": section}, 1)
    before = {k: v.clone() for k, v in receiver.base.items()}
    with pytest.raises(NeedFull, match="against version 7 .* holds version 0"):
        receiver.apply(bucket.manifest, bucket.tensors(), 1)
    assert receiver.version == 0 and all(torch.equal(receiver.base[k], v) for k, v in before.items())
    # the fallback the transport takes in the same step: the sender's base, whole
    assert all(torch.equal(dict(sender.items())[n], t) for n, t in versions[1])


def corrupted(monkeypatch=None):
    versions = trained_versions(torch.bfloat16, steps=3)
    sender, receiver = DeltaSender(), DeltaBase()
    push(sender, receiver, versions[0], 0, delta=False)
    push(sender, receiver, versions[1], 1)
    wire, section = sender.encode(versions[2], delta=True)
    bucket = over_the_wire(wire, {"delta": section}, 2)
    name = next(iter(section["codec"]))
    receiver.base[name] = receiver.base[name].clone()
    receiver.base[name].view(-1)[3] += 1  # the receiver's base differs from what the sender thinks it holds
    return receiver, bucket, name, dict(versions[2])[name]


def test_a_tensor_that_does_not_match_its_digest_is_refused_and_the_base_dropped():
    receiver, bucket, name, _ = corrupted()
    with pytest.raises(NeedFull, match=f"{name!r} after the delta does not match its digest"):
        receiver.apply(bucket.manifest, bucket.tensors(), 2)
    assert receiver.version is None and not receiver.base  # nothing of it is used: the next push is full


def test_negative_control_without_the_digest_the_wrong_base_gives_wrong_weights(monkeypatch):
    receiver, bucket, name, want = corrupted()
    codec = bucket.manifest["delta"]["codec"]
    monkeypatch.setattr(delta_mod, "tensor_digest", lambda t: codec[name]["xxh3"] if t.shape == want.shape else "")
    receiver.apply(bucket.manifest, [(n, t) for n, t in bucket.tensors() if n == name], 2)
    assert not torch.equal(receiver.base[name], want)


def test_a_delta_that_does_not_decompress_is_refused():
    versions = trained_versions(torch.float32, steps=3)
    sender, receiver = DeltaSender(), DeltaBase()
    push(sender, receiver, versions[0], 0, delta=False)
    wire, section = sender.encode(versions[1], delta=True)
    name = next(iter(section["codec"]))
    wire = [(n, t[: len(t) // 2] if n == name else t) for n, t in wire]  # cut short
    with pytest.raises(NeedFull, match="does not decompress|holds"):
        receiver.apply({"delta": section}, wire, 1)
    assert receiver.version is None


def sparse_pair(positions, numel=1 << 18):
    """(sender, receiver, (wire, section)) for one bf16 tensor changed at `positions` after a full push."""
    g = torch.Generator().manual_seed(0)
    before = torch.randn(numel, generator=g).to(torch.bfloat16)
    after = before.clone()
    after.view(torch.int16)[torch.tensor(positions)] ^= 1  # the last bit of the mantissa: every one changes
    sender, receiver = DeltaSender(), DeltaBase()
    push(sender, receiver, [("w", before)], 0, delta=False)
    return after, receiver, sender.encode([("w", after)], delta=True)


GAPS = {  # gap widths: all gaps short; a few long (kept aside as int32); too many long for 1 byte; for 2 bytes
    "1 byte": (list(range(0, 200_000, 37)), 1, 0),
    "1 byte + long": (list(range(0, 100_000, 37)) + [160_000, 230_000, 261_000], 1, 3),
    "2 bytes": (list(range(0, 260_000, 300)), 2, 0),
    "4 bytes": ([5, 70_000, 140_000, 210_000, 262_000], 4, 0),
}


@pytest.mark.parametrize("case", GAPS)
def test_sparse_gaps_take_the_narrowest_width_and_apply_bitwise(case):
    positions, width, n_long = GAPS[case]
    after, receiver, (wire, section) = sparse_pair(positions)
    spec = section["codec"]["w"]
    assert (spec["codec"], spec["count"], spec["gap_bytes"], spec["long_gaps"]) == (
        "sparse_zstd",
        len(positions),
        width,
        n_long,
    )
    bucket = over_the_wire(wire, {"delta": section}, 1)
    receiver.apply(bucket.manifest, bucket.tensors(), 1)
    assert torch.equal(receiver.base["w"].view(torch.int16), after.view(torch.int16))


def recoded(wire, edit) -> list:
    """`wire` with the one coded tensor's raw bytes passed through `edit` and compressed again."""
    import zstandard

    ((name, blob),) = wire
    raw = bytearray(zstandard.ZstdDecompressor().decompress(blob.numpy().tobytes(), max_output_size=1 << 30))
    edit(raw)
    return [(name, torch.frombuffer(bytearray(zstandard.ZstdCompressor().compress(bytes(raw))), dtype=torch.uint8))]


def test_sparse_positions_out_of_range_are_refused():
    """The last long gap (int32, at the end) pointed past the tensor's end; negative control: the same bytes
    unedited apply."""
    _, receiver, (wire, section) = sparse_pair(GAPS["1 byte + long"][0])
    bad = recoded(wire, lambda raw: raw.__setitem__(slice(-4, None), (10**9).to_bytes(4, "little")))
    with pytest.raises(NeedFull, match="out of order or range"):
        receiver.apply({"delta": section}, bad, 1)
    assert receiver.version is None


def test_a_long_gap_count_that_does_not_match_the_marks_is_refused():
    """A second gap marked long (0) while the manifest names 3 long gaps."""
    _, receiver, (wire, section) = sparse_pair(GAPS["1 byte + long"][0])
    with pytest.raises(NeedFull, match="4 long gaps marked, 3 sent"):
        receiver.apply({"delta": section}, recoded(wire, lambda raw: raw.__setitem__(1, 0)), 1)


def test_negative_control_the_unedited_sparse_delta_applies():
    after, receiver, (wire, section) = sparse_pair(GAPS["1 byte + long"][0])
    receiver.apply({"delta": section}, recoded(wire, lambda raw: None), 1)
    assert torch.equal(receiver.base["w"].view(torch.int16), after.view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_tensor_is_scanned_in_chunks_without_missing_a_change_at_their_edges(monkeypatch, threads):
    """`DeltaSender._changed` scans a tensor over two CHUNKs a chunk at a time (numpy, on `threads` threads): the
    changes on each side of every chunk edge are found, in order, as torch's own `nonzero` finds them."""
    monkeypatch.setattr(delta_mod, "CHUNK", 1000)
    positions = [0, 1, 998, 999, 1000, 1001, 1999, 2000, 4321, 4999, 5000, 6999]
    after, receiver, (wire, section) = sparse_pair(positions, numel=7000)
    before = receiver.base["w"].clone()
    sender = DeltaSender(threads=threads)
    got = sender._changed(after.view(torch.int16).numpy(), before.view(torch.int16).numpy())
    assert got.tolist() == torch.ne(after.view(torch.int16), before.view(torch.int16)).nonzero().view(-1).tolist()
    assert got.tolist() == positions
    bucket = over_the_wire(wire, {"delta": section}, 1)
    receiver.apply(bucket.manifest, bucket.tensors(), 1)
    assert torch.equal(receiver.base["w"].view(torch.int16), after.view(torch.int16))


def test_negative_control_a_scan_that_misses_a_chunk_edge_is_caught_by_the_digest(monkeypatch):
    """A scan that drops the last change of each chunk sends a delta the receiver's digest check refuses."""
    monkeypatch.setattr(delta_mod, "CHUNK", 1000)
    real = delta_mod.np.flatnonzero
    monkeypatch.setattr(delta_mod.np, "flatnonzero", lambda mask: real(mask)[:-1])
    after, receiver, (wire, section) = sparse_pair([5, 999, 1000, 2500, 3999], numel=4000)
    bucket = over_the_wire(wire, {"delta": section}, 1)
    with pytest.raises(NeedFull, match="digest"):
        receiver.apply(bucket.manifest, bucket.tensors(), 1)
