"""Export by direct sends: every TP rank of a stage sends its own shards of each bucket straight to the destination,
into the place each piece has in the HF tensor where the layout allows. Each byte crosses the wire once, from its
owner (a TP all-gather moves every shard to every TP rank, and the stage's first rank then packed and forwarded
what it had gathered); a replicated tensor comes from TP0 alone.

Protocol, per data-parallel replica and PP stage (its members: the stage's TP ranks at that replica's DP rank, CP0),
all point to point on the CPU group, in order per pair of ranks (gloo matches a pair's messages first in, first out):
  1. the stage's TP0 sends the destination (unless it is a member and cuts the plan itself) a JSON header: the
     stage's buckets (`_plan` cuts them from shapes, so every member cuts the same ones), each a list of
     {spec: the parameter's mapping (class name and fields, rebuilt from KINDS, never code), shape, dtype};
  2. for each bucket, each member sends its pieces as they lie (no packing copy), by dtype, then bucket order;
  3. the destination receives into one buffer per dtype laid out tensor by tensor, TP parts back to back (a gate/up
     shard's halves into the gate and the up halves), so column-parallel tensors, the vocabulary and gate/up come
     out as views; row-parallel ones and q/k/v are copied out (their HF layouts interleave the parts).
Bucket k+1 is received while bucket k is handed out (members keep at most two buckets in flight), and the destination reads every stage's header first, so the next stage's transfer starts at once.
Used for dense weights (no expert parallelism, no expert parameters); `export.py` falls back to gathers otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque

import torch
import torch.distributed as dist

from mgrpo.models.lora import effective_weight
from mgrpo.parallel.device import cpu_group
from mgrpo.weights.bucket import DTYPES, dtype_name
from mgrpo.weights.mappings import QKV, Column, GatedMLP, Replicated, Row, Vocab

AHEAD = 2  # buckets the destination has receives posted for
KINDS = {cls.__name__: cls for cls in (Replicated, Column, Row, Vocab, QKV, GatedMLP)}


def spec_of(mapping) -> dict:
    """A mapping as JSON: its class name and dataclass fields."""
    out = {f.name: getattr(mapping, f.name) for f in dataclasses.fields(mapping)}
    out["hf_names"] = list(mapping.hf_names)
    return dict(out, kind=type(mapping).__name__)


def mapping_of(spec: dict):
    fields = {k: v for k, v in spec.items() if k != "kind"}
    return KINDS[spec["kind"]](**dict(fields, hf_names=tuple(fields["hf_names"])))


def supported(params: list) -> bool:
    """Whether every (param, mapping) of this rank can travel by direct sends."""
    return all(type(m) in KINDS.values() and not m.expert for _, m in params)


def _header(plan: list) -> list:
    return [
        [{"spec": spec_of(m), "shape": list(p.shape), "dtype": dtype_name(p.dtype)} for p, m in bucket]
        for bucket in plan
    ]


def pieces(kind: str, t: int, tp: int, n: int) -> list:
    """(start in the shard, length, offset in the tensor's region) of what TP rank t sends of an n-element shard."""
    if kind == "Replicated":
        return [(0, n, 0)] if t == 0 else []
    if kind == "GatedMLP":  # [gate_t; up_t] -> the gate region [gate_0 .. gate_tp-1], then the up region
        h = n // 2
        return [(0, h, t * h), (h, h, tp * h + t * h)]
    return [(0, n, t * n)]


def _layout(bucket: list, tp: int) -> dict:
    """dtype -> (total elements, [(entry index, region offset, shard numel)]): each tensor's region in the buffer."""
    out = {}
    for i, e in enumerate(bucket):
        n = math.prod(e["shape"])
        total, entries = out.setdefault(e["dtype"], [0, []])
        entries.append((i, total, n))
        out[e["dtype"]][0] = total + (n if e["spec"]["kind"] == "Replicated" else n * tp)
    return out


def _assemble(spec: dict, region: torch.Tensor, shape: list, tp: int) -> dict:
    """HF tensors from a tensor's filled region."""
    n = math.prod(shape)
    if spec["kind"] == "Replicated":
        return {spec["hf_names"][0]: region[:n].view(shape)}
    if spec["kind"] == "GatedMLP":
        half = [tp * shape[0] // 2, *shape[1:]]
        gate, up = spec["hf_names"]
        return {gate: region[: tp * n // 2].view(half), up: region[tp * n // 2 :].view(half)}
    return mapping_of(spec).unshard([region[t * n : (t + 1) * n].view(shape) for t in range(tp)])


def _shards(group: list, tp: int, t: int, select) -> list:
    """TP rank t's pieces of one bucket as flat views, in the order the destination posts its receives."""
    chosen = [(dtype_name(p.dtype), m, select(p).reshape(-1)) for p, m in group]
    return [
        flat[a : a + n]
        for d in sorted({c[0] for c in chosen})
        for dd, m, flat in chosen
        if dd == d
        for a, n, _ in pieces(type(m).__name__, t, tp, flat.numel())
    ]


def _send_json(obj, dst: int) -> None:
    raw = json.dumps(obj).encode()
    g = cpu_group()
    dist.send(torch.tensor([len(raw)], dtype=torch.long), dst, group=g)
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=g)


def _recv_json(src: int):
    n, g = torch.zeros(1, dtype=torch.long), cpu_group()
    dist.recv(n, src, group=g)
    raw = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(raw, src, group=g)
    return json.loads(raw.numpy().tobytes().decode())


def send_stage(plan: list, members: list, target: int, select=effective_weight) -> None:
    """A member's side for one stage (the member is not the destination): the header (TP0, unless the destination
    is a member and cuts the plan itself), then its pieces."""
    me = dist.get_rank()
    if me == members[0] and target not in members:
        _send_json(_header(plan), target)
    in_flight = deque()
    for group in plan:
        shards = _shards(group, len(members), members.index(me), select)
        shards = [x.contiguous().cpu() for x in shards]  # gloo sends host memory (a GPU shard is staged, as before)
        in_flight.append(([dist.isend(x, target, group=cpu_group()) for x in shards], shards))
        if len(in_flight) > 2:
            for w in in_flight.popleft()[0]:
                w.wait()
    for works, _ in in_flight:
        for w in works:
            w.wait()


class _Incoming:
    """One bucket on its way to the destination: receives posted at once into a buffer per dtype (and a copy of the
    destination's own pieces where it is a member)."""

    def __init__(self, bucket: list, members: list, own: list | None):
        self.bucket, self.tp, me = bucket, len(members), dist.get_rank()
        self.layout, self.bufs, self.works = _layout(bucket, self.tp), {}, []
        for d in sorted(self.layout):
            total, entries = self.layout[d]
            self.bufs[d] = buf = torch.empty(total, dtype=DTYPES[d])  # fresh: what is handed out may be kept
            for t, member in enumerate(members):
                for i, off, n in entries:
                    for a, length, at in pieces(bucket[i]["spec"]["kind"], t, self.tp, n):
                        where = buf[off + at : off + at + length]
                        if member != me:
                            self.works.append(dist.irecv(where, member, group=cpu_group()))
                        else:
                            where.copy_(own[i].reshape(-1)[a : a + length])

    def tensors(self):
        """The bucket's HF tensors (views of its buffers, or copies)."""
        for w in self.works:
            w.wait()
        for d, (total, entries) in self.layout.items():
            ends = [off for _, off, _ in entries[1:]] + [total]
            for (i, off, _), end in zip(entries, ends):
                e = self.bucket[i]
                yield from _assemble(e["spec"], self.bufs[d][off:end], e["shape"], self.tp).items()
        del self.bufs


def receive(stages: list, plans: dict, select=effective_weight, ahead: int = AHEAD):
    """The destination's side: (hf_name, full tensor) for every stage in order. `stages` lists each stage's members;
    `plans[s]` is stage s's plan where the destination is one of its members (it then cuts the plan itself).
    `ahead`: buckets with receives posted (1 where the consumer copies each bucket away before asking for more)."""
    me = dist.get_rank()
    jobs = []
    for s, members in enumerate(stages):
        if me in members:
            jobs += [(_header([g])[0], members, g) for g in plans[s]]
        else:
            jobs += [(bucket, members, None) for bucket in _recv_json(members[0])]
    posted = deque()
    for k in range(len(jobs)):
        while len(posted) < ahead and k + len(posted) < len(jobs):
            bucket, members, group = jobs[k + len(posted)]
            if members == [me]:  # TP1: its own tensors, taken when asked for, as the gather path does
                posted.append((kv for p, m in group for kv in m.unshard([select(p)]).items()))
            else:
                own = None if group is None else [select(p) for p, _ in group]  # a LoRA merge lives for one bucket
                posted.append(_Incoming(bucket, members, own).tensors())  # receives posted now
        yield from posted.popleft()
