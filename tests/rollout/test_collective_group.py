"""The collective plane's groups and wire (`transports/collective_group.py`) between two plain processes: a sender
and a receiver join a group on a TCPStore under a nonce; buckets of mixed dtypes (an empty one included) arrive
bit-exact and in order, then END. Over gloo here; over NCCL (marked gpu) where two GPUs exist."""

import datetime
import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from mgrpo.weights.bucket import pack_bucket


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        [("a", torch.randn(3, 5, generator=g)), ("b", torch.randint(0, 9, (7,), generator=g))],
        [("c", torch.randn(64, 33, generator=g).to(torch.bfloat16))],
        [],
        [("d", torch.randn(1000, generator=g))],
    ]


def _peer(rank: int, port: int, backend: str, out):
    from mgrpo.weights.transports.collective_group import join_group, receive_buckets, send_bucket, send_end

    if backend == "nccl":
        torch.cuda.set_device(rank)
    group = join_group("127.0.0.1", port, "n" * 32, 0, rank, 2, backend, timeout_s=30)
    if rank == 0:
        for i, items in enumerate(_tensors(1)):
            bucket = pack_bucket(items, 1, i, checksum=False)
            if backend == "nccl":
                bucket.flat = bucket.flat.cuda()
            for _, works in send_bucket([group], bucket):
                for w in works:
                    w.wait()
        for _, works in send_end([group]):
            for w in works:
                w.wait()
        out.put("sent")
    else:
        got = [[(n, t.cpu().clone()) for n, t in b.tensors()] for b in receive_buckets(group)]
        want = [items for items in _tensors(1)]
        same = len(got) == len(want) and all(
            [n for n, _ in g] == [n for n, _ in w] and all(torch.equal(a, b) for (_, a), (_, b) in zip(g, w))
            for g, w in zip(got, want)
        )
        out.put(("received", same, len(got)))
    group.close()


def _run(backend: str):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(r, store.port, backend, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


def test_buckets_cross_a_gloo_group_bit_exact():
    results = _run("gloo")
    print(results)
    assert "sent" in results and ("received", True, 4) in results  # the empty bucket arrives empty


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_buckets_cross_an_nccl_group_bit_exact():
    results = _run("nccl")
    assert "sent" in results and ("received", True, 4) in results


def test_the_handshake_refuses_other_torch_or_nccl_versions_in_one_line():
    """Both ends of a collective group send their versions (`wire_versions`); a torch of another minor version, or
    over NCCL another NCCL, is refused before any group forms (peers of different NCCL versions can hang)."""
    from mgrpo.weights.transports.collective_group import version_mismatch, wire_versions

    mine = wire_versions("gloo")
    assert mine["torch"] and version_mismatch(mine, dict(mine), "gloo") is None
    assert version_mismatch({"torch": "2.13.0"}, {"torch": "2.13.1"}, "gloo") is None  # patch releases share a wire
    line = version_mismatch({"torch": "2.13.0"}, {"torch": "2.11.0"}, "gloo")
    assert "torch 2.13.0 (trainer) vs 2.11.0 (server)" in line and "\n" not in line
    ok = {"torch": "2.11.0", "nccl": "2.27.3"}
    assert version_mismatch(ok, dict(ok), "nccl") is None
    assert "NCCL 2.26.2 (trainer) vs 2.27.3 (server)" in version_mismatch({**ok, "nccl": "2.26.2"}, ok, "nccl")
    assert "NCCL None (trainer)" in version_mismatch({"torch": "2.11.0", "nccl": None}, ok, "nccl")  # no CUDA
    assert version_mismatch({"torch": "2.11.0", "nccl": None}, {"torch": "2.11.0"}, "gloo") is None
