"""Would deltas speed up the colocated engine's push? Full vs delta into shared memory, side by side in one run.

The colocated transport (`transports/shared_memory.py`) sends nothing over a wire: the trainer copies each tensor
once into a buffer the engine's worker maps, and the worker hands views of it to vLLM. A delta would replace that
copy with the sender's encode (XOR with its base, positions, zstd: `weights/delta.py::DeltaSender`), a copy of
the smaller coded bytes, and the receiver's apply onto its own base (decompress, XOR, digest). Both sides would
then hold a base copy of the model in host memory. vLLM's load of the result is the same either way, so it is
left out.

The limit beside it: the full copy itself, at this machine's memory bandwidth. The tensors are bf16 at the ~85M
size (`--params`), and a fraction `--changed` of their elements change per step. The default 0.035 is the middle
of what real steps at LR 1e-6 changed on this model (2.3-4.3%, ../shared/CPU_FACTS.md); the positions are drawn
at random, so zstd sees no structure a real step might have. torch runs on one thread (as in a pinned colocated
layout); zstd as the sender sets it (one thread per core).

    python benchmarks/delta_shm.py [--params 85e6] [--changed 0.035] [--steps 5]

Ends with: result: full_copy_s=... delta_s=... delta_vs_full=... (delta time over full time: above 1, deltas make the
colocated push slower) encode_s=... apply_s=... wire_frac=...
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tensors(params: float, seed: int = 0) -> list:
    """About `params` parameters of bf16 matrices, shaped as a hidden-768 transformer's layers."""
    g = torch.Generator().manual_seed(seed)
    hidden, out = 768, []
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden
    layers = max(1, int(params // per_layer))
    for i in range(layers):
        for name, shape in (("qkvo", (4 * hidden, hidden)), ("mlp", (12 * hidden, hidden))):
            out.append((f"layers.{i}.{name}", (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)))
    return out


def shm_buffer(nbytes: int) -> tuple:
    """A file in /dev/shm mapped writable, as a uint8 tensor (what the worker would map too)."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="mgrpo-delta-bench-")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.fill_(0)  # first-touch page faults paid here, as the transport's kept buffers do
    return buf, mm


def copy_into(buf: torch.Tensor, items: list) -> int:
    offset = 0
    for _, t in items:
        n = t.numel() * t.element_size()
        buf[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += n
    return offset


def step(items: list, changed: float, g: torch.Generator) -> list:
    """A new version: `changed` of each tensor's elements moved by one bf16 rounding step or more."""
    out = []
    for name, t in items:
        mask = torch.rand(t.shape, generator=g) < changed
        bumped = (t.float() * (1 + 2 * torch.sign(torch.randn(t.shape, generator=g)) * 2**-7)).to(torch.bfloat16)
        out.append((name, torch.where(mask, bumped, t)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=85e6)
    ap.add_argument("--changed", type=float, default=0.035)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if not 0 < args.changed < 1 or args.steps < 1 or args.params < 1e6:
        ap.error("--changed in (0, 1), --steps >= 1, --params >= 1e6")
    from mgrpo.weights.delta import DeltaBase, DeltaSender

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    items = tensors(args.params)
    dense = sum(t.numel() * t.element_size() for _, t in items)
    buf, _mapping = shm_buffer(dense)  # kept mapped while `buf` views it
    sender, receiver = DeltaSender(), DeltaBase()
    sender.encode(items, delta=False)
    sender.commit(0)
    receiver.set(0, {n: t.clone() for n, t in items})
    rows = []
    for version in range(1, args.steps + 1):
        items = step(items, args.changed, g)
        t0 = time.perf_counter()
        copy_into(buf, items)  # the full push's copy
        t1 = time.perf_counter()
        sender.reset_stats()
        wire, section = sender.encode(items, delta=True)
        t2 = time.perf_counter()
        copy_into(buf, wire)
        t3 = time.perf_counter()
        receiver.apply({"delta": section}, wire, version)
        receiver.version = version
        t4 = time.perf_counter()
        sender.commit(version)
        assert all(torch.equal(receiver.base[n], t) for n, t in items), "the receiver's base must equal the version"
        rows.append(dict(full=t1 - t0, encode=t2 - t1, copy=t3 - t2, apply=t4 - t3, wire=sender.stats["wire_bytes"]))
        r = rows[-1]
        print(
            f"step {version}: full copy {r['full']:.3f} s; delta encode {r['encode']:.3f} + copy {r['copy']:.4f} + "
            f"apply {r['apply']:.3f} s; wire {r['wire'] / dense:.3f} of {dense / 1e6:.0f} MB",
            flush=True,
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    delta_s = med["encode"] + med["copy"] + med["apply"]
    print(
        f"\nmedians over {args.steps} steps, {dense / 1e6:.0f} MB of bf16, {args.changed:.1%} of the elements changed "
        f"per step: the full copy runs at {dense / med['full'] / 1e9:.1f} GB/s; the delta path "
        f"takes {delta_s / med['full']:.1f}x as long, and each side keeps a {dense / 1e6:.0f} MB base"
    )
    print(
        f"result: full_copy_s={med['full']:.4f} delta_s={delta_s:.4f} delta_vs_full={delta_s / med['full']:.2f} "
        f"encode_s={med['encode']:.4f} apply_s={med['apply']:.4f} wire_frac={med['wire'] / dense:.4f}"
    )


if __name__ == "__main__":
    main()
