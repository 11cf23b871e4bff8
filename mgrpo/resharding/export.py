"""Sharded megatron chunks -> full HF-named tensors on one destination rank.

PP stages take turns; within a stage each parameter is gathered over TP with its mapping's inverse,
and the stage's first rank ships the stage's tensors to the destination as one flat buffer with a JSON
header (names, dtypes, shapes). Bucketing with a byte bound comes with the resharding-out work.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.parallel.pipeline import unwrap
from mgrpo.resharding.name_map import chunk_mappings


def _coords() -> torch.Tensor:
    """[world, 4] of (pp, tp, dp, cp) ranks."""
    mine = torch.tensor([mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
                         mpu.get_data_parallel_rank(), mpu.get_context_parallel_rank()])
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out)


def full_hf_tensors(model_chunks, select=None):
    """(hf_name, full tensor) for this PP stage's parameters, gathered over TP (every TP rank must call).

    `select(param)` picks what to gather: the value by default, e.g. `lambda p: p.main_grad` for gradients.
    """
    tp_group = mpu.get_tensor_model_parallel_group()
    for chunk in model_chunks:
        model = unwrap(chunk)
        tied_output = model.share_embeddings_and_output_weights
        for name, param, mapping in chunk_mappings(model):
            if name == "output_layer.weight" and tied_output:
                continue  # same tensor as embed_tokens
            yield from mapping.gather((select or (lambda p: p.detach()))(param), tp_group).items()


def _send(tensors: list, dst: int):
    header = json.dumps([(n, str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in tensors]).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.long), dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst)
    for dtype in sorted({t.dtype for _, t in tensors}, key=str):
        flat = torch.cat([t.reshape(-1) for _, t in tensors if t.dtype == dtype]) if tensors else None
        dist.send(flat, dst)


def _recv(src: int):
    n = torch.zeros(1, dtype=torch.long)
    dist.recv(n, src)
    raw = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(raw, src)
    meta = json.loads(bytes(raw.tolist()).decode())
    out = {}
    for dtype_name in sorted({d for _, d, _ in meta}, key=lambda d: str(getattr(torch, d))):
        dtype = getattr(torch, dtype_name)
        items = [(name, shape) for name, d, shape in meta if d == dtype_name]
        flat = torch.empty(sum(int(torch.tensor(s).prod()) if s else 1 for _, s in items), dtype=dtype)
        dist.recv(flat, src)
        off = 0
        for name, shape in items:
            numel = int(torch.tensor(shape).prod()) if shape else 1
            out[name] = flat[off: off + numel].view(shape)
            off += numel
    return [(name, out[name]) for name, _, _ in meta]


def export_hf(model_chunks: list, dst: int = 0):
    """Yield (hf_name, full tensor) on global rank `dst`; every rank must drive the iterator."""
    coords = _coords()
    me = dist.get_rank()
    for stage in range(mpu.get_pipeline_model_parallel_world_size()):
        src = next(r for r in range(len(coords)) if coords[r].tolist() == [stage, 0, 0, 0])
        in_stage = coords[me, 0] == stage and coords[me, 2] == 0 and coords[me, 3] == 0
        if in_stage:
            tensors = list(full_hf_tensors(model_chunks))
            if me == src and src == dst:
                yield from tensors
            elif me == src:
                _send(tensors, dst)
        if me == dst and src != dst:
            yield from _recv(src)
