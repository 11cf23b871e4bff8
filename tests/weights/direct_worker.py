"""torchrun worker (world 4) for test_direct_export.py: export by direct sends against the gather path and the
source safetensors, bitwise, at TP2xPP2 into a destination that is neither stage's TP0 (rank 3) and at TP2xDP2
into one destination per data-parallel replica."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mgrpo.config import ParallelConfig  # noqa: E402
from mgrpo.parallel.distributed import init_distributed  # noqa: E402
from mgrpo.parallel.state import setup_model_parallel  # noqa: E402


def compare(model: str, parallel, per_dp: bool) -> dict:
    from megatron.core import parallel_state as mpu

    from mgrpo.models.builder import build_model
    from mgrpo.weights.export import export_hf, rank_coords
    from mgrpo.weights.load import SafetensorsReader, load_hf

    chunks = build_model(model, parallel)
    load_hf(chunks, model)
    coords = rank_coords()
    dst = (
        {
            d: next(r for r in range(len(coords)) if coords[r, :4].tolist() == [0, 0, d, 0])
            for d in range(mpu.get_data_parallel_world_size())
        }
        if per_dp
        else 3
    )
    got = {}
    for direct in (True, False):
        got[direct] = {n: t.clone() for n, t in export_hf(chunks, dst=dst, bucket_bytes=48 << 10, direct=direct)}
    targets = dst.values() if per_dp else (dst,)
    if dist.get_rank() not in targets:
        return {"received": len(got[True]) + len(got[False])}
    reader = SafetensorsReader(model)
    return {
        "names": len(got[True]),
        "mismatched": [n for n in reader.where if n not in got[True] or not torch.equal(got[True][n], reader.read(n))],
        "differs_from_gather": sorted(n for n in got[False] if not torch.equal(got[True].get(n), got[False][n])),
        "extra": sorted(set(got[True]) - set(reader.where)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(backend="gloo")
    out = {}
    for tag, parallel, per_dp in (
        ("tp2-pp2", ParallelConfig(tp=2, pp=2), False),
        ("tp2-dp2", ParallelConfig(tp=2), True),
    ):
        setup_model_parallel(parallel)
        out[tag] = compare(args.model, parallel, per_dp)
        dist.barrier()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
