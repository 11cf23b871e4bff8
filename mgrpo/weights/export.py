"""Sharded megatron chunks -> full HF-named tensors, streamed bucket by bucket to one destination rank.

PP stages take turns, so no rank holds more than its own stage plus one bucket in flight. Within a stage
the parameters are grouped into buckets of about `bucket_bytes` (full size); each bucket costs one TP
all-gather per dtype (not one per parameter), each mapping's inverse rebuilds the HF tensors (QKV
de-interleave, gate/up split, vocabulary padding trimmed), and the stage's first rank ships the bucket to
the destination as a flat buffer with a JSON manifest. Memory stays near one bucket plus the largest tensor.
On CPU (gloo TP groups) `export_hf` sends dense weights another way (`direct_export.py`): each TP rank's shards go
straight to the destination, which unshards them; so do the stage senders' streams (`stage_tensors`, to the stage's
TP0). The gathers above serve NCCL (GPU) TP groups, experts, gradients and LoRA adapters.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.models.lora import effective_weight
from mgrpo.parallel.device import cpu_group
from mgrpo.parallel.pipeline import unwrap
from mgrpo.weights import direct_export
from mgrpo.weights.bucket import Bucket, cut_buckets, pack_bucket
from mgrpo.weights.name_map import chunk_mappings

DEFAULT_BUCKET_BYTES = 256 << 20


def rank_coords() -> torch.Tensor:
    """[world, 5] of (pp, tp, dp, cp, expert-dp) ranks."""
    mine = torch.tensor(
        [
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
            mpu.get_context_parallel_rank(),
            mpu.get_expert_data_parallel_rank(),
        ]
    )
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=cpu_group())
    return torch.stack(out)


def _stage_params(model_chunks):
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, param, mapping in chunk_mappings(model):
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue  # same tensor as embed_tokens
            yield param, mapping


def _plan(params: list, bucket_bytes: int, tp: int, expert_size: int) -> list:
    """Buckets of about bucket_bytes (full size) in module order; dense and expert parameters never share one (they
    gather over different groups). The plan depends on shapes only, so every rank cuts the same buckets."""
    groups, cur, size = [], [], 0
    for local, mapping in params:
        n = local.numel() * local.element_size() * (expert_size if mapping.expert else tp)
        if cur and (size + n > bucket_bytes or mapping.expert != cur[0][1].expert):
            groups.append(cur)
            cur, size = [], 0
        cur.append((local, mapping))
        size += n
    return groups + ([cur] if cur else [])


def _full(mapping, parts: list, etp: int) -> dict:
    """HF tensors from one parameter's gathered parts: its TP shards, or an expert slot's shards on every EP rank."""
    return mapping.unshard_ep(parts, etp) if mapping.expert else mapping.unshard(parts)


def _gather_group(group: list, pg, size: int, etp: int = 1, select=effective_weight):
    """Full HF tensors of one bucket with one all-gather per dtype over `pg` (TP, or expert-TP x EP for experts);
    yielded one parameter at a time (a consumer that copies each away holds the gathered shards and one parameter's
    full tensors, not the bucket's). `select(param)` is taken bucket by bucket (a LoRA merge lives for one bucket)."""
    if size == 1:
        for param, m in group:
            yield from _full(m, [select(param)], etp).items()
        return
    group = [(select(param), m) for param, m in group]
    parts_of = {}
    for dtype in {local.dtype for local, _ in group}:
        members = [(i, local) for i, (local, _) in enumerate(group) if local.dtype == dtype]
        flat = torch.cat([local.reshape(-1) for _, local in members]) if len(members) > 1 else members[0][1].reshape(-1)
        gathered = torch.empty(size, flat.numel(), dtype=dtype, device=flat.device)
        if dist.get_backend(pg) == "nccl":
            dist.all_gather_into_tensor(gathered.view(-1), flat.contiguous(), group=pg)
        else:  # gloo stages all_gather_into_tensor through one more full-size copy than this
            dist.all_gather(list(gathered.unbind(0)), flat.contiguous(), group=pg)
        del flat
        off = 0
        for i, local in members:
            parts_of[i] = [gathered[r, off : off + local.numel()].view(local.shape) for r in range(size)]
            off += local.numel()
        del gathered  # the parts keep it alive until the last of them is unsharded
    for i, (_, m) in enumerate(group):
        yield from _full(m, parts_of.pop(i), etp).items()


def full_hf_tensors(
    model_chunks,
    select=None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    coalesce: bool = True,
    dense: bool = True,
    experts: bool = True,
):
    """(hf_name, full tensor) for this PP stage: dense parameters gathered over TP, experts over expert-TP x EP
    (every expert of the layer, named by its global index); every rank of those groups must iterate.

    `select(param)` picks what to gather: the value (a LoRA run's with its adapter folded in) by default, e.g.
    `lambda p: p.main_grad` for gradients.
    `coalesce=False` gathers parameter by parameter (the benchmark's baseline). `dense`/`experts`: which of the two
    this rank takes part in (an EP peer outside the exporting replica joins only the experts' gathers).
    """
    select = select or effective_weight
    tp_group, tp = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size()
    eg, esize = mpu.get_expert_tensor_and_model_parallel_group(), mpu.get_expert_tensor_and_model_parallel_world_size()
    etp = mpu.get_expert_tensor_parallel_world_size()
    params = list(_stage_params(model_chunks))
    for group in ([p] for p in params) if not coalesce else _plan(params, bucket_bytes, tp, esize):
        if group[0][1].expert and experts:
            yield from _gather_group(group, eg, esize, etp, select)
        elif not group[0][1].expert and dense:
            yield from _gather_group(group, tp_group, tp, select=select)


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
    """Regroup a (name, tensor) stream into lists within bucket_bytes, to send rank to rank (bucket.cut_buckets)."""
    return cut_buckets(stream, bucket_bytes, align=1)


def stage_senders() -> list:
    """Global ranks of each PP stage's (DP0, TP0, CP0) rank, by stage: the senders of `stage_buckets`."""
    coords = rank_coords()
    return [
        next(r for r in range(len(coords)) if coords[r, :4].tolist() == [stage, 0, 0, 0])
        for stage in range(mpu.get_pipeline_model_parallel_world_size())
    ]


def _exporter_roles() -> tuple:
    """(dense, experts): whether this rank takes part in its stage's export gathers. Dense: the DP0/CP0 ranks (TP
    gathers). Experts: with EP > 1 the exporter's expert-data-parallel group 0 (its EP peers hold the other
    experts, whatever their dense DP or CP rank); with EP = 1 the same ranks as dense."""
    dense = mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
    if mpu.get_expert_model_parallel_world_size() == 1:
        return dense, dense
    return dense, mpu.get_expert_data_parallel_rank() == 0


def _stage_stream(model_chunks: list, bucket_bytes: int):
    """This stage's full tensors on its (DP0, TP0, CP0) rank; the stage's other exporting ranks send or gather."""
    dense, experts = _exporter_roles()
    if not (dense or experts):
        return
    params = list(_stage_params(model_chunks))
    if _direct_fits(params):  # the stage's TP ranks send their shards straight to its TP0 (no all-gather)
        tp_group = mpu.get_tensor_model_parallel_group()
        members = sorted(dist.get_process_group_ranks(tp_group), key=lambda r: dist.get_group_rank(tp_group, r))
        plan = _plan(params, bucket_bytes, len(members), 1)
        if dist.get_rank() == members[0]:
            yield from direct_export.receive([members], {0: plan}, ahead=1)
        else:
            direct_export.send_stage(plan, members, members[0])
        return
    stream = full_hf_tensors(model_chunks, bucket_bytes=bucket_bytes, dense=dense, experts=experts)
    if dense and mpu.get_tensor_model_parallel_rank() == 0:
        yield from stream
    else:
        for _ in stream:
            pass


def stage_tensors(model_chunks: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """This PP stage's weights as (hf_name, full tensor), one parameter's at a time, on the stage's (DP0, TP0, CP0)
    rank only (each fresh memory or a live parameter, which no push changes: a consumer may hold several, as
    `CollectiveTransport._coded` does); the stage's other TP ranks of DP0/CP0 send it their shards
    (dense weights; with experts they, and the exporter's EP peers, take part in gathers of about `bucket_bytes`);
    every other rank returns."""
    yield from _stage_stream(model_chunks, bucket_bytes)


def stage_buckets(model_chunks: list, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """This PP stage's weights as full HF tensors in lists of about `bucket_bytes`, yielded on the stage's (DP0, TP0,
    CP0) rank only; the ranks of its gathers take part; every other rank returns at once. Stages run at the same
    time and nothing crosses stages: no rank holds more than its stage's buckets."""
    yield from _buckets_of(_stage_stream(model_chunks, bucket_bytes), bucket_bytes)


def export_hf(
    model_chunks: list,
    dst=0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    coalesce: bool = True,
    tensors=full_hf_tensors,
    direct: bool = True,
):
    """Yield (hf_name, full tensor) on global rank `dst`; every rank must drive the iterator.

    `dst` may map data-parallel ranks to destinations ({dp_rank: global rank}): each listed DP replica then
    exports its own copy of the weights to its own destination (one engine per DP group), at the same time, or
    one replica after another with expert parallelism (an EP group spans replicas: each replica's export needs its
    exporter's EP peers). A destination must belong to the replica it receives from. Tensors are views or fresh
    copies valid until the caller asks for the next bucket's worth. `tensors`: what each stage streams (the weights;
    `lora.peft_tensors` for a LoRA run's adapters only).

    Dense weights on a gloo TP group travel by direct sends (`direct_export`: each TP rank's shards straight to the
    destination); on NCCL (GPUs), with expert parameters, `direct=False`, `coalesce=False` or other `tensors`, each
    stage gathers over TP (or expert groups) and its first rank forwards the buckets.
    """
    coords = rank_coords()
    dsts = dst if isinstance(dst, dict) else {0: dst}
    for d, target in dsts.items():
        if int(coords[target, 2]) != d:
            raise ValueError(f"export destination rank {target} is not in data-parallel replica {d}")
    params = list(_stage_params(model_chunks))
    if direct and coalesce and tensors is full_hf_tensors and _direct_everywhere(params):
        if int(coords[dist.get_rank(), 2]) in dsts:
            d = int(coords[dist.get_rank(), 2])
            yield from _direct_replica(params, coords, d, dsts[d], bucket_bytes)
    elif mpu.get_expert_model_parallel_world_size() > 1:
        for d in sorted(dsts):
            yield from _export_replica(model_chunks, coords, d, dsts[d], bucket_bytes, coalesce, tensors)
    elif int(coords[dist.get_rank(), 2]) in dsts:
        d = int(coords[dist.get_rank(), 2])
        yield from _export_replica(model_chunks, coords, d, dsts[d], bucket_bytes, coalesce, tensors)


def _export_replica(model_chunks, coords, d: int, target: int, bucket_bytes: int, coalesce: bool, tensors):
    """Data-parallel replica d's weights to `target`, stage by stage: each stage's (d, TP0, CP0) rank gathers (with
    its TP group; experts with the ranks of its expert-data-parallel rank) and sends its buckets to the target."""
    me, ep = dist.get_rank(), mpu.get_expert_model_parallel_world_size()
    for stage in range(mpu.get_pipeline_model_parallel_world_size()):
        src = next(r for r in range(len(coords)) if coords[r, :4].tolist() == [stage, 0, d, 0])
        dense = int(coords[me, 2]) == d and int(coords[me, 3]) == 0
        experts = int(coords[me, 4]) == int(coords[src, 4]) if ep > 1 else dense
        # a target inside the stage's gathers gets the full tensors from them (a send to it would deadlock them)
        target_gathers = (
            int(coords[target, 0]) == stage
            and int(coords[target, 3]) == 0
            and (ep == 1 or int(coords[target, 4]) == int(coords[src, 4]))
        )
        if coords[me, 0] == stage and (dense or experts):
            stream = tensors(model_chunks, bucket_bytes=bucket_bytes, coalesce=coalesce, dense=dense, experts=experts)
            if me == target and target_gathers:
                yield from stream
            elif me == src and not target_gathers:
                for items in _buckets_of(stream, bucket_bytes):
                    _send_bucket(pack_bucket(items, 0, 0, checksum=False), target)
                _send_bucket(pack_bucket([], 0, 0, checksum=False), target)  # end of this stage
            else:
                for _ in stream:  # the other TP ranks (and EP peers) take part in the gathers
                    pass
        if me == target and not target_gathers:
            while True:
                bucket = _recv_bucket(src)
                yield from bucket.tensors()
                if not bucket.manifest["names"]:
                    break


def _direct_fits(params: list) -> bool:
    """Direct sends serve dense weights over a CPU (gloo) TP group; with NCCL the TP all-gather runs on the GPUs'
    links while direct sends would stage every shard through host memory and gloo (no NCCL point to point yet)."""
    tp_group = mpu.get_tensor_model_parallel_group()
    return (
        mpu.get_expert_model_parallel_world_size() == 1
        and direct_export.supported(params)
        and dist.get_backend(tp_group) != "nccl"
    )


def _direct_everywhere(params: list) -> bool:
    """Whether every rank's parameters can travel by direct sends, agreed by all ranks."""
    ok = torch.tensor([int(_direct_fits(params))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group())
    return bool(ok)


def _direct_replica(params: list, coords, d: int, target: int, bucket_bytes: int):
    """Data-parallel replica d's weights to `target` by direct sends: the members of each stage (its TP ranks at
    DP rank d, CP0) send their shards; the target receives and unshards every stage in turn."""
    me, tp = dist.get_rank(), mpu.get_tensor_model_parallel_world_size()
    stages = [
        [next(r for r in range(len(coords)) if coords[r, :4].tolist() == [s, t, d, 0]) for t in range(tp)]
        for s in range(mpu.get_pipeline_model_parallel_world_size())
    ]
    stage = int(coords[me, 0])
    plan = _plan(params, bucket_bytes, tp, 1) if me in stages[stage] else None
    if me == target:
        yield from direct_export.receive(stages, {stage: plan})
    elif plan is not None:
        direct_export.send_stage(plan, stages[stage], target)
