"""Weight export at TP2 x PP2 (4 gloo processes) on a ~450 MB fp32 model: direct sends (each TP rank's shards
straight to the destination, the default), bucketed coalesced TP gathers forwarded by each stage's first rank, and
one all-gather per parameter, side by side in one run, against the point-to-point limit (each rank's own bytes sent
to rank 0 as they lie, in the same run), a plain memcpy of the same bytes and the
sha256 a checked transport adds (payload + manifest of the exported tensors packed in buckets).

    .venv/bin/python benchmarks/weight_export.py [--bucket-mb 32] [--reps 4]

Figures are measured on global rank 0, which receives every full tensor (as the rollout engine's rank does).
Peak RSS is the increase during the export, sampled every 0.5 ms. Memcpy and sha256 are best of 3, on
rank 0 alone, after the exports (so they do not compete with the other processes for cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9


def worker(bucket_mb: int, reps: int):
    import torch
    import torch.distributed as dist

    from mgrpo.config import ParallelConfig
    from mgrpo.models.builder import build_model
    from mgrpo.models.hf_config import ModelInfo
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.profiling import PeakRSS
    from mgrpo.weights.bucket import digest, make_buckets
    from mgrpo.weights.export import export_hf

    init_distributed(backend="gloo")
    parallel = ParallelConfig(tp=2, pp=2)
    setup_model_parallel(parallel)
    info = ModelInfo(
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    chunks = build_model(info, parallel)
    results, largest = {}, 0
    for label, coalesce, direct in (("direct", True, True), ("coalesced", True, False), ("per_param", False, False)):
        times, peaks, nbytes = [], [], 0
        for _ in range(reps):
            dist.barrier()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                nbytes = 0
                for _, t in export_hf(chunks, dst=0, bucket_bytes=bucket_mb << 20, coalesce=coalesce, direct=direct):
                    nbytes += t.numel() * t.element_size()
                    largest = max(largest, t.numel() * t.element_size())
                dist.barrier()
                times.append(time.perf_counter() - t0)
            peaks.append(mem.increase_mb)
        peaks = torch.tensor(peaks)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank's
        results[label] = {"time_s": min(times), "bytes": nbytes, "peak_rss_mb": float(peaks.max())}
    results["p2p_limit"] = {
        "time_s": min(p2p_to_rank0(chunks, bucket_mb << 20) for _ in range(reps)),
        "bytes": results["direct"]["bytes"],
    }
    results["largest_mb"] = largest / 2**20
    # one more export, kept on rank 0 as unchecked buckets, to time the digest a checked transport would add
    stream = export_hf(chunks, dst=0, bucket_bytes=bucket_mb << 20)
    buckets = []
    if dist.get_rank() == 0:
        buckets = list(make_buckets(stream, bucket_mb << 20, version=1, checksum=False))
    else:
        for _ in stream:  # every rank drives the export
            pass
    dist.barrier()
    if dist.get_rank() == 0:
        n = results["coalesced"]["bytes"]
        src, dst = torch.randn(n // 4), torch.empty(n // 4)
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
        results["memcpy"] = {"time_s": best, "bytes": n}
        best = min(_timed(lambda: [digest(b.flat, b.manifest) for b in buckets]) for _ in range(3))
        results["sha256"] = {"time_s": best, "bytes": sum(b.flat.numel() for b in buckets)}
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def p2p_to_rank0(chunks, bucket_bytes: int) -> float:
    """The limit: every rank's own parameter bytes, as they lie (no gather, no reshaping), sent point to point to
    rank 0 in bucket-sized messages; rank 0 receives from each owner in turn. Seconds until all have arrived."""
    import torch
    import torch.distributed as dist

    mine = torch.cat([p.detach().flatten().view(torch.uint8) for c in chunks for p in c.parameters()])
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([mine.numel()]))
    dist.barrier()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        for src in range(1, dist.get_world_size()):
            buf = torch.empty(int(sizes[src]), dtype=torch.uint8)
            for start in range(0, buf.numel(), bucket_bytes):
                dist.recv(buf[start : start + bucket_bytes], src=src)
    else:
        for start in range(0, mine.numel(), bucket_bytes):
            dist.send(mine[start : start + bucket_bytes], dst=0)
    dist.barrier()
    return time.perf_counter() - t0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args.bucket_mb, args.reps)
    from mgrpo.parallel.distributed import free_port

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--master-port={free_port()}",
        os.path.abspath(__file__),
        "--worker",
        "--bucket-mb",
        str(args.bucket_mb),
        "--reps",
        str(args.reps),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.stderr.write(out.stderr[-4000:])
        sys.exit(1)
    r = json.loads(lines[-1][len("RESULT ") :])
    print(
        f"TP2 x PP2, 4 gloo processes on {os.cpu_count()} cores, bucket {args.bucket_mb} MB, "
        f"{r['direct']['bytes'] / 1e6:.0f} MB exported to rank 0"
    )
    print(f"{'variant':<12}{'time s':>10}{'GB/s':>10}{'s per GB':>10}{'peak RSS MB (worst rank)':>26}")
    for k in ("direct", "coalesced", "per_param", "p2p_limit", "memcpy", "sha256"):
        v = r[k]
        gbps = v["bytes"] / v["time_s"] / GB
        print(f"{k:<12}{v['time_s']:>10.3f}{gbps:>10.3f}{1 / gbps:>10.3f}{v.get('peak_rss_mb', 0):>26.0f}")
    e, c, p, m, h = (
        r[k]["bytes"] / r[k]["time_s"] / GB for k in ("direct", "coalesced", "per_param", "memcpy", "sha256")
    )
    bound = args.bucket_mb + r["largest_mb"] + 64
    print(
        f"direct / coalesced gathers: {e / c:.2f}x; coalesced / per-parameter: {c / p:.2f}x; direct / memcpy: "
        f"{e / m:.3f}"
    )
    print(
        f"memory bound (bucket + largest tensor {r['largest_mb']:.0f} MB + 64 MB): {bound:.0f} MB; direct's worst "
        f"rank {r['direct']['peak_rss_mb']:.0f} MB"
    )
    print(
        f"sha256 (payload + manifest): {h:.3f} GB/s = {1 / h:.3f} s per GB, vs memcpy {m:.3f} GB/s = "
        f"{1 / m:.3f} s per GB; checking would add {e / h:.2f}x the direct export time"
    )
    limit = r["p2p_limit"]["bytes"] / r["p2p_limit"]["time_s"] / GB
    print(
        f"p2p limit (every owner's bytes sent as they lie to rank 0; rank 0's own share not moved): {limit:.3f} "
        f"GB/s of exported model; export / limit: {e / limit:.2f}"
    )
    print(
        f"result: export_gbps={e:.3f} p2p_limit_gbps={limit:.3f} export_vs_limit={e / limit:.2f} "
        f"gather_gbps={c:.3f} direct_vs_gather={e / c:.2f} per_param_gbps={p:.3f} memcpy_gbps={m:.3f} "
        f"peak_rss_mb={r['direct']['peak_rss_mb']:.0f} rss_bound_mb={bound:.0f} sha256_gbps={h:.3f}"
    )


if __name__ == "__main__":
    main()
