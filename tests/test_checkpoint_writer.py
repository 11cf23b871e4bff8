"""The async-save writer (mgrpo/checkpoint_writer.py): its snapshot is what the tensors held at save time, each rebuilt
tensor writes only its own bytes, and a writer that died completes its save with an error instead of a hang.
Its end-to-end check is tests/test_checkpoint.py's DP2 async-save resume, equal bitwise to the uninterrupted run."""

import io
import time

import pytest
import torch

from mgrpo.checkpoint_writer import SpawnedWriter, rebuild, snapshot


def buckets():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    return [
        (
            "f0",
            "k0",
            (
                [("bytes-item", io.BytesIO(b"abc"))],
                [("w", w), ("wt", w.t()), ("h", torch.randn(7, generator=g).to(torch.bfloat16))],
            ),
        ),
        (
            "f1",
            "k1",
            (
                [],
                [
                    ("step", torch.tensor(3, dtype=torch.int64)),
                    ("empty", torch.zeros(0, 4)),
                    ("half", torch.randn(3, 3, generator=g).half()[:, 1]),
                ],
            ),
        ),
    ]


def test_snapshot_keeps_save_time_values_and_each_tensor_writes_only_its_bytes():
    original = buckets()
    expected = [[t.clone() for _, t in b[2][1]] for b in original]
    buffer, slots = snapshot(original)
    for _, _, (_, items) in original:  # the next optimizer step
        for _, t in items:
            t.add_(1)
    got = rebuild(buffer, slots)
    assert [b[:2] for b in got] == [("f0", "k0"), ("f1", "k1")]
    assert got[0][2][0][0][1].getvalue() == b"abc"
    for want, (_, _, (_, items)) in zip(expected, got):
        for ref, (_, t) in zip(want, items):
            assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(t, ref)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            alone, mine = io.BytesIO(), io.BytesIO()
            torch.save(ref.clone(), alone)
            torch.save(t, mine)
            assert len(mine.getvalue()) == len(alone.getvalue())


def test_views_of_the_buffer_would_write_all_of_it():
    """Negative control for the rebuild: a plain view of the shared buffer serialises the whole buffer."""
    buffer, slots = snapshot(buckets())
    offset, dtype, shape = slots[0][2][1][0][1]
    view = buffer[offset : offset + 30 * 4].view(dtype).view(shape)
    out = io.BytesIO()
    torch.save(view, out)
    assert len(out.getvalue()) >= buffer.numel()


def test_a_dead_writer_completes_its_save_with_an_error():
    writer = SpawnedWriter()
    writer.start()
    writer.process.kill()
    writer.in_flight = 1
    started = time.time()
    assert writer.is_current_async_call_done(blocking=True, no_dist=True)
    assert time.time() - started < 10
    with pytest.raises(RuntimeError, match="exited with code"):
        raise writer.results.get_nowait()
    writer.close()
    assert writer.process is None
