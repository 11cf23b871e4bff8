"""Sharded megatron chunks -> full HF-named tensors, streamed bucket by bucket to one destination rank.

PP stages take turns, so no rank holds more than its own stage plus one bucket in flight. Within a stage
the parameters are grouped into buckets of about `bucket_bytes` (full size); each bucket costs one TP
all-gather per dtype (not one per parameter), each mapping's inverse rebuilds the HF tensors (QKV
de-interleave, gate/up split, vocabulary padding trimmed), and the stage's first rank ships the bucket to
the destination as a flat buffer with a JSON manifest. Memory stays near one bucket plus the largest tensor.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.parallel.device import cpu_group
from mgrpo.parallel.pipeline import unwrap
from mgrpo.resharding.bucket import Bucket, pack_bucket
from mgrpo.resharding.name_map import chunk_mappings

DEFAULT_BUCKET_BYTES = 256 << 20


def _coords() -> torch.Tensor:
    """[world, 4] of (pp, tp, dp, cp) ranks."""
    mine = torch.tensor([mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
                         mpu.get_data_parallel_rank(), mpu.get_context_parallel_rank()])
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=cpu_group())
    return torch.stack(out)


def _stage_params(model_chunks, select):
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, param, mapping in chunk_mappings(model):
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue  # same tensor as embed_tokens
            yield select(param), mapping


def _plan(params: list, bucket_bytes: int, tp: int) -> list:
    groups, cur, size = [], [], 0
    for local, mapping in params:
        n = local.numel() * local.element_size() * tp
        if cur and size + n > bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((local, mapping))
        size += n
    return groups + ([cur] if cur else [])


def _gather_group(group: list, tp_group, tp: int):
    """Full HF tensors of one bucket with one all-gather per dtype over TP; yielded one parameter at a time (a
    consumer that copies each away holds the gathered shards and one parameter's full tensors, not the bucket's)."""
    if tp == 1:
        for local, m in group:
            yield from m.unshard([local]).items()
        return
    parts_of = {}
    for dtype in {local.dtype for local, _ in group}:
        members = [(i, local) for i, (local, _) in enumerate(group) if local.dtype == dtype]
        flat = torch.cat([local.reshape(-1) for _, local in members]) if len(members) > 1 else \
            members[0][1].reshape(-1)
        gathered = torch.empty(tp, flat.numel(), dtype=dtype, device=flat.device)
        if dist.get_backend(tp_group) == "nccl":
            dist.all_gather_into_tensor(gathered.view(-1), flat.contiguous(), group=tp_group)
        else:  # gloo stages all_gather_into_tensor through one more full-size copy than this
            dist.all_gather(list(gathered.unbind(0)), flat.contiguous(), group=tp_group)
        del flat
        off = 0
        for i, local in members:
            parts_of[i] = [gathered[r, off: off + local.numel()].view(local.shape) for r in range(tp)]
            off += local.numel()
        del gathered  # the parts keep it alive until the last of them is unsharded
    for i, (_, m) in enumerate(group):
        yield from m.unshard(parts_of.pop(i)).items()


def full_hf_tensors(model_chunks, select=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, coalesce: bool = True):
    """(hf_name, full tensor) for this PP stage, gathered over TP; every TP rank of the stage must iterate.

    `select(param)` picks what to gather: the value by default, e.g. `lambda p: p.main_grad` for gradients.
    `coalesce=False` gathers parameter by parameter (the benchmark's baseline).
    """
    select = select or (lambda p: p.detach())
    tp_group, tp = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()
    params = list(_stage_params(model_chunks, select))
    if not coalesce:
        for local, mapping in params:
            yield from mapping.gather(local, tp_group).items()
        return
    for group in _plan(params, bucket_bytes, tp):
        yield from _gather_group(group, tp_group, tp)


def _send_bucket(bucket: Bucket, dst: int) -> None:
    """Buckets are packed in host memory (`pack_bucket`) and go to the engine's rank over the CPU group."""
    header, g = json.dumps(bucket.manifest).encode(), cpu_group()
    dist.send(torch.tensor([len(header), bucket.flat.numel()], dtype=torch.long), dst, group=g)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=g)
    if bucket.flat.numel():
        dist.send(bucket.flat.cpu(), dst, group=g)


def _recv_bucket(src: int) -> Bucket:
    sizes, g = torch.zeros(2, dtype=torch.long), cpu_group()
    dist.recv(sizes, src, group=g)
    raw = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(raw, src, group=g)
    flat = torch.empty(int(sizes[1]), dtype=torch.uint8)
    if flat.numel():
        dist.recv(flat, src, group=g)
    return Bucket(flat, json.loads(raw.numpy().tobytes().decode()))


def _buckets_of(stream, bucket_bytes: int):
    """Regroup a (name, tensor) stream into lists of about bucket_bytes."""
    cur, size = [], 0
    for name, t in stream:
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


def stage_senders() -> list:
    """Global ranks of each PP stage's (DP0, TP0, CP0) rank, by stage: the senders of `stage_buckets`."""
    coords = _coords()
    return [next(r for r in range(len(coords)) if coords[r].tolist() == [stage, 0, 0, 0])
            for stage in range(mpu.get_pipeline_model_parallel_world_size())]


def stage_tensors(model_chunks: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """This PP stage's weights as (hf_name, full tensor), one parameter's at a time, on the stage's (DP0, TP0, CP0)
    rank only (each valid until the next is asked for); the stage's other TP ranks of DP0/CP0 take part in the
    gathers (TP groups of about `bucket_bytes`); every other rank returns at once."""
    if mpu.get_data_parallel_rank() != 0 or mpu.get_context_parallel_rank() != 0:
        return
    stream = full_hf_tensors(model_chunks, bucket_bytes=bucket_bytes)
    if mpu.get_tensor_model_parallel_rank() == 0:
        yield from stream
    else:
        for _ in stream:
            pass


def stage_buckets(model_chunks: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """This PP stage's weights as full HF tensors in lists of about `bucket_bytes`, yielded on the stage's (DP0, TP0,
    CP0) rank only; the stage's other TP ranks of DP0/CP0 take part in the gathers; every other rank returns at
    once. Stages run at the same time and nothing crosses stages: no rank holds more than its stage's buckets."""
    if mpu.get_data_parallel_rank() != 0 or mpu.get_context_parallel_rank() != 0:
        return
    stream = full_hf_tensors(model_chunks, bucket_bytes=bucket_bytes)
    if mpu.get_tensor_model_parallel_rank() == 0:
        yield from _buckets_of(stream, bucket_bytes)
    else:
        for _ in stream:
            pass


def export_hf(model_chunks: list, dst=0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, coalesce: bool = True):
    """Yield (hf_name, full tensor) on global rank `dst`; every rank must drive the iterator.

    `dst` may map data-parallel ranks to destinations ({dp_rank: global rank}): each listed DP replica then
    exports its own copy of the weights to its own destination at the same time (one engine per DP group); a
    destination must belong to the replica it receives from. Tensors are views or fresh copies valid until
    the caller asks for the next bucket's worth.
    """
    coords = _coords()
    me = dist.get_rank()
    dsts = dst if isinstance(dst, dict) else {0: dst}
    for d, target in dsts.items():
        if int(coords[target, 2]) != d:
            raise ValueError(f"export destination rank {target} is not in data-parallel replica {d}")
    my_dp = int(coords[me, 2])
    if my_dp not in dsts:
        return
    target = dsts[my_dp]
    for stage in range(mpu.get_pipeline_model_parallel_world_size()):
        src = next(r for r in range(len(coords)) if coords[r].tolist() == [stage, 0, my_dp, 0])
        if coords[me, 0] == stage and coords[me, 3] == 0:
            stream = full_hf_tensors(model_chunks, bucket_bytes=bucket_bytes, coalesce=coalesce)
            if me == src == target:
                yield from stream
            elif me == src:
                for items in _buckets_of(stream, bucket_bytes):
                    _send_bucket(pack_bucket(items, 0, 0, checksum=False), target)
                _send_bucket(pack_bucket([], 0, 0, checksum=False), target)  # end of this stage
            else:
                for _ in stream:  # the other TP ranks take part in the gathers
                    pass
        if me == target and src != target:
            while True:
                bucket = _recv_bucket(src)
                yield from bucket.tensors()
                if not bucket.manifest["names"]:
                    break
