"""Benchmark: fused vocab-parallel logprob/entropy vs. a naive full-vocabulary version.

Settings (defaults): vocabulary 152064 (Qwen2), 2048 tokens, fp32 and bf16 logits,
TP1 (in this process) and TP2 (gloo, 2 spawned processes, rank 0 reported), temperature
1.0. For each setting it runs "logprob" and "logprob + entropy", forward-only (under
``torch.no_grad``, as for old/reference logprobs) and forward+backward (loss
``sum(w1 * logprob) [+ sum(w2 * entropy)]``, gradient taken with ``torch.autograd.grad``).

naive: all_gather the logit shards (TP2; the local shard stays differentiable), cast the
full ``[T, V]`` logits to fp32, ``log_softmax``, gather the targets; entropy is
``-(p * logp).sum(-1)``.
fused: ``mgrpo.loss.logprobs.vocab_parallel_logprobs`` (default chunk size unless
``--chunk`` is given).

Memory: "peak extra" = the peak, over one call, of bytes held by tensors allocated during
the call, measured with ``torch.profiler.profile(profile_memory=True)``: every CPU
allocation and free of the torch allocator is recorded as a ``[memory]`` event with its
address and size, and the events are replayed in order into a running total. Tensors that
exist before the call (input logits, targets, weights) are therefore not counted, frees of
them are ignored, and the gradient w.r.t. the input logits (the tensor returned by
``autograd.grad``, still alive at the end) is excluded by subtracting its bytes from the
allocation that holds it (for naive TP2 that allocation is the full ``[T, V]`` gradient,
of which the local shard's gradient is a view; the rest of it still counts). This sees
exactly torch tensor memory, independent of malloc caching/RSS noise; it does not see
non-torch buffers (e.g. gloo internals), which are tiny here.

Time: median over ``--reps`` calls after one untimed call (the profiled one); naive and
fused calls are interleaved so that load changes on a shared machine hit both alike; on
TP2 a barrier precedes each timed call. Runtime: ~6 min on 2 idle cores (naive
fwd+bwd at [2048, 152064] fp32 alone takes 3-7 s per call); ``--quick`` (512 tokens,
1 rep) takes ~1 min.

The last printed line is
``result: fwd_mem_ratio=A fwdbwd_mem_ratio=B time_ratio=C`` (fused / naive, vocab 152064
(``--vocab``), fp32, TP1, logprob + entropy; time_ratio is forward+backward).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

try:
    import mgrpo  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mgrpo.loss.logprobs import vocab_parallel_logprobs  # noqa: E402

MiB = 1 << 20


# --------------------------------------------------------------------------- variants
def naive_logprobs(x, targets, group, temperature=1.0, compute_entropy=False):
    if group is not None and dist.get_world_size(group) > 1:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.detach().contiguous(), group=group)
        parts[rank] = x  # gradient flows to the local shard only (loss is replicated)
        full = torch.cat(parts, dim=-1)
        del parts
    else:
        full = x
    z = full.float()
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return lp, ent


def run_step(impl, entropy, backward, x, targets, w1, w2, group, chunk):
    """One call; returns (logprob, entropy, grad) with grad None for forward-only."""
    fn = vocab_parallel_logprobs if impl == "fused" else naive_logprobs
    kwargs = dict(compute_entropy=entropy)
    if impl == "fused":
        kwargs["chunk_size"] = chunk
    if not backward:
        with torch.no_grad():
            lp, ent = fn(x, targets, group, **kwargs)
        return lp, ent, None
    lp, ent = fn(x, targets, group, **kwargs)
    loss = (w1 * lp).sum()
    if entropy:
        loss = loss + (w2 * ent).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), (ent.detach() if entropy else None), grad


# --------------------------------------------------------------------------- measurement
@contextlib.contextmanager
def _quiet_stderr():
    """Silence kineto's C-level profiler_start/stop log lines (fd 2) around a profile."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_extra_bytes(call):
    """(peak extra bytes excluding the returned input-gradient, call's result)."""
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = call()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: e["ts"])
    mem = [
        (int(e["args"]["Addr"]), int(e["args"]["Bytes"])) for e in events if int(e["args"].get("Device Type", 0)) == 0
    ]
    grad = out[2]
    # allocations still alive at the end, to find the one holding the gradient
    alive = {}
    last_alloc_idx = {}
    for i, (addr, nbytes) in enumerate(mem):
        if nbytes > 0:
            alive[addr] = nbytes
            last_alloc_idx[addr] = i
        else:
            alive.pop(addr, None)
    skip = {}
    if grad is not None:
        ptr, gbytes = grad.data_ptr(), grad.numel() * grad.element_size()
        holders = [a for a, n in alive.items() if a <= ptr < a + n]
        if holders:
            skip[last_alloc_idx[holders[0]]] = gbytes
    running, peak, live = 0, 0, {}
    for i, (addr, nbytes) in enumerate(mem):
        if nbytes > 0:
            nbytes -= skip.get(i, 0)
            live[addr] = nbytes
            running += nbytes
        elif addr in live:  # frees of tensors allocated before the call are ignored
            running -= live.pop(addr)
        peak = max(peak, running)
    return peak, out


def bench_setting(tokens, vocab, dtype, group, reps, chunk, seed=0):
    rank = 0 if group is None else dist.get_rank(group)
    world = 1 if group is None else dist.get_world_size(group)
    v_local = vocab // world
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, v_local * world, (tokens,), generator=g)
    w1 = torch.randn(tokens, generator=g)
    w2 = torch.randn(tokens, generator=g)
    gx = torch.Generator().manual_seed(seed + 1 + rank)
    x = (torch.randn(tokens, v_local, generator=gx) * 2.0).to(dtype).requires_grad_()
    rows = []
    impls = ("naive", "fused")
    for entropy in (False, True):
        outs = {}
        for backward in (False, True):
            calls = {
                impl: (lambda impl=impl: run_step(impl, entropy, backward, x, targets, w1, w2, group, chunk))
                for impl in impls
            }
            peaks, times = {}, {impl: [] for impl in impls}
            for impl in impls:  # the profiled call doubles as the warm-up
                peaks[impl], out = peak_extra_bytes(calls[impl])
                if not backward:
                    outs[impl] = out[:2]
                del out
            for _ in range(reps):  # interleaved, so load changes hit both alike
                for impl in impls:
                    if group is not None:
                        dist.barrier(group)
                    t0 = time.perf_counter()
                    out = calls[impl]()
                    times[impl].append(time.perf_counter() - t0)
                    del out
            gc.collect()
            for impl in impls:
                rows.append(
                    dict(
                        tp=world,
                        dtype=str(dtype).replace("torch.", ""),
                        what="logprob+entropy" if entropy else "logprob",
                        mode="fwd+bwd" if backward else "fwd",
                        impl=impl,
                        peak_bytes=peaks[impl],
                        time_s=statistics.median(times[impl]),
                    )
                )
        # sanity: fused and naive agree
        diff = float((outs["fused"][0] - outs["naive"][0]).abs().max())
        if entropy:
            diff = max(diff, float((outs["fused"][1] - outs["naive"][1]).abs().max()))
        rows[-1]["max_abs_diff"] = diff
    return rows


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, out_path, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=1800)
    )
    rows = []
    for dtype in args["dtypes"]:
        rows += bench_setting(
            args["tokens"], args["vocab"], getattr(torch, dtype), dist.group.WORLD, args["reps"], args["chunk"]
        )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- report
def print_table(rows):
    by = {}
    for r in rows:
        by.setdefault((r["tp"], r["dtype"], r["what"], r["mode"]), {})[r["impl"]] = r
    hdr = (
        f"{'tp':>2} {'dtype':>8} {'what':>16} {'mode':>7} | {'naive MiB':>9} "
        f"{'fused MiB':>9} {'mem f/n':>7} | {'naive s':>8} {'fused s':>8} {'time f/n':>8}"
        f" | {'max|f-n|':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for key in sorted(by, key=lambda k: (k[0], k[1] != "float32", k[2], k[3])):
        n, f = by[key]["naive"], by[key]["fused"]
        diff = f.get("max_abs_diff")
        print(
            f"{key[0]:>2} {key[1]:>8} {key[2]:>16} {key[3]:>7} | "
            f"{n['peak_bytes'] / MiB:9.1f} {f['peak_bytes'] / MiB:9.1f} "
            f"{f['peak_bytes'] / max(n['peak_bytes'], 1):7.3f} | "
            f"{n['time_s']:8.3f} {f['time_s']:8.3f} {f['time_s'] / n['time_s']:8.3f} | "
            + (f"{diff:8.1e}" if diff is not None else f"{'':>8}")
        )
    return by


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="fused chunk size (tokens)")
    ap.add_argument("--tp", type=str, default="1,2")
    ap.add_argument("--dtypes", type=str, default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1 rep")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = 512, 1
    dtypes = args.dtypes.split(",")
    tps = [int(t) for t in args.tp.split(",")]
    print(
        f"vocab={args.vocab} tokens={args.tokens} reps={args.reps} chunk={args.chunk} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}",
        flush=True,
    )
    rows = []
    t0 = time.perf_counter()
    if 1 in tps:
        for dtype in dtypes:
            rows += bench_setting(args.tokens, args.vocab, getattr(torch, dtype), None, args.reps, args.chunk)
            print(f"  done tp=1 {dtype} ({time.perf_counter() - t0:.0f}s)", flush=True)
    for world in [t for t in tps if t > 1]:
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "rows.json")
            wargs = dict(tokens=args.tokens, vocab=args.vocab, reps=args.reps, chunk=args.chunk, dtypes=dtypes)
            mp.spawn(_tp_worker, args=(world, _free_port(), out_path, wargs), nprocs=world, join=True)
            with open(out_path) as f:
                rows += json.load(f)
        print(f"  done tp={world} ({time.perf_counter() - t0:.0f}s)", flush=True)
    print()
    by = print_table(rows)
    key_f, key_b = (1, "float32", "logprob+entropy", "fwd"), (1, "float32", "logprob+entropy", "fwd+bwd")
    if key_f in by and key_b in by:
        fwd = by[key_f]["fused"]["peak_bytes"] / by[key_f]["naive"]["peak_bytes"]
        fb = by[key_b]["fused"]["peak_bytes"] / by[key_b]["naive"]["peak_bytes"]
        tr = by[key_b]["fused"]["time_s"] / by[key_b]["naive"]["time_s"]
        print(
            f"\ntotal {time.perf_counter() - t0:.0f}s; goals: fwd_mem_ratio <= 0.25, "
            f"fwdbwd_mem_ratio <= 0.5, time_ratio <= 1.25"
        )
        print(f"result: fwd_mem_ratio={fwd:.4f} fwdbwd_mem_ratio={fb:.4f} time_ratio={tr:.3f}")


if __name__ == "__main__":
    main()
