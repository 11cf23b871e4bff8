"""Peak activation memory per rank for one 8192-token sequence on the tiny model: CP1 vs CP2, one run.

    .venv/bin/python benchmarks/cp_memory.py [--seq 8192]

Each layout runs in its own torchrun launch (CP1: 1 process, CP2: 2 processes on gloo). A rank measures the
increase of its resident memory over a full forward+backward (the sampled peak minus the level before),
which is activations plus the small gradient buffers of the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(model_dir: str, seq: int, cp: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.loss.aggregation import token_weights
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.profiling import PeakRSS
    from mgrpo.rollout.types import Sample

    init_distributed()
    cfg = load_config(
        argv=["--model.path", model_dir, "--data.path", "unused.jsonl", "--cp", str(cp)], check_files=False
    )
    setup_model_parallel(cfg.parallel)
    actor = Actor(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    prompt = 64
    sample = Sample(
        prompt_ids=torch.randint(3, 300, (prompt,), generator=g).tolist(),
        response_ids=torch.randint(3, 300, (seq - prompt,), generator=g).tolist(),
        loss_mask=[1] * (seq - prompt),
    )
    mb = make_microbatches(
        [sample],
        1,
        0,
        [1.0],
        token_weights=token_weights([sample], "token-mean"),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cp,
    )[0]
    mb["old_logp"] = torch.zeros_like(mb["loss_mask"])
    dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        actor.forward_backward([mb])
    result = {
        "cp": cp,
        "rank": dist.get_rank(),
        "local_tokens": int(mb["input_ids"].shape[1]),
        "peak_increase_mb": mem.increase_mb,
        "time_s": time.perf_counter() - t0,
    }
    # one write per line: both ranks share the pipe, and under PYTHONUNBUFFERED print() writes the text and its
    # newline separately, so two ranks' lines could interleave (seen once in CI)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def launch(model_dir: str, seq: int, cp: int) -> list:
    from mgrpo.parallel.distributed import free_port

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cp}",
        f"--master-port={free_port()}",
        os.path.abspath(__file__),
        "--worker",
        "--model",
        model_dir,
        "--seq",
        str(seq),
        "--cp",
        str(cp),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or len(rows) != cp:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"cp={cp} launch failed")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--cp", type=int, default=1)
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.seq, args.cp)
    from mgrpo.models.tiny import make_tiny_hf

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf(os.path.join(tmp, "tiny"), "qwen2", max_position_embeddings=max(4096, args.seq))
        cp1, cp2 = launch(model, args.seq, 1), launch(model, args.seq, 2)
    print(f"tiny qwen2 (hidden 128, 2 layers, 4 heads), one sequence of {args.seq} tokens, forward+backward")
    print(f"{'layout':<8}{'rank':>6}{'local tokens':>14}{'peak +MB':>12}{'time s':>10}")
    for r in cp1 + cp2:
        print(
            f"{'CP' + str(r['cp']):<8}{r['rank']:>6}{r['local_tokens']:>14}{r['peak_increase_mb']:>12.0f}"
            f"{r['time_s']:>10.2f}"
        )
    one = cp1[0]["peak_increase_mb"]
    two = max(r["peak_increase_mb"] for r in cp2)
    print(f"result: cp1_peak_mb={one:.0f} cp2_peak_mb={two:.0f} ratio={two / one:.3f}")


if __name__ == "__main__":
    main()
