"""torchrun worker (world 2) for test_bias_export.py: a biased Llama at TP2 and PP2.

Per layout: HF -> megatron -> export_hf round trip against the safetensors (bitwise), TP2 logits for the HF
comparison, and at PP2 a checkpoint with one extra layer-1 tensor, which only stage 1 holds, must fail on
every rank (the consumed set is the whole model's, not the stage's).
"""

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


def round_trip(model: str, parallel) -> dict:
    from megatron.core import parallel_state as mpu

    from mgrpo.models.builder import build_model
    from mgrpo.models.forward import full_logits
    from mgrpo.weights.export import export_hf
    from mgrpo.weights.load import SafetensorsReader, load_hf

    chunks = build_model(model, parallel)
    load_hf(chunks, model)
    res = {}
    got = {name: t.clone() for name, t in export_hf(chunks, dst=0, bucket_bytes=64 << 10)}
    if dist.get_rank() == 0:
        reader = SafetensorsReader(model)
        res["names"] = len(got)
        res["mismatched"] = [n for n in reader.where if n not in got or not torch.equal(got[n], reader.read(n))]
        res["extra"] = sorted(set(got) - set(reader.where))
    if parallel.pp == 1:
        ids = torch.load(os.path.join(os.path.dirname(model), "ids.pt"))
        shard = full_logits(chunks[0], ids).contiguous()
        parts = [torch.empty_like(shard) for _ in range(mpu.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, shard, group=mpu.get_tensor_model_parallel_group())
        if dist.get_rank() == 0:
            torch.save(torch.cat(parts, -1)[..., : chunks[0].mgrpo_info.vocab_size], model + ".tp2.logits.pt")
    return res


def unconsumed(bad: str, parallel) -> str:
    from mgrpo.models.builder import build_model
    from mgrpo.weights.load import CheckpointError, load_hf

    chunks = build_model(bad, parallel)
    try:
        load_hf(chunks, bad)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bad", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(backend="gloo")
    out = {}
    for tag, parallel in (("tp2", ParallelConfig(tp=2)), ("pp2", ParallelConfig(pp=2))):
        setup_model_parallel(parallel)
        out[tag] = round_trip(args.model, parallel)
        if tag == "pp2":
            out["pp2_unconsumed"] = unconsumed(args.bad, parallel)
        dist.barrier()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
