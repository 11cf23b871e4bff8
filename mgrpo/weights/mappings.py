"""How one megatron parameter is cut from (and glued back into) full HF tensors.

Each mapping knows its HF names, how to read this TP rank's shard (reading only the needed rows or
columns through a `TensorReader`), and its inverse: gather a full tensor set from the TP shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


class TensorReader:
    """Reads slices of named tensors; backed by safetensors files or an in-memory dict."""

    def shape(self, name: str) -> tuple:
        raise NotImplementedError

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        raise NotImplementedError


def _all_gather(local: torch.Tensor, group) -> list:
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [local]
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


def _cat0(parts: list) -> torch.Tensor:
    """torch.cat along dim 0, but a free view when the TP parts already lie back to back in one buffer (as
    the coalesced all-gather leaves them). One part is copied, so an export never aliases a live parameter."""
    base = parts[0]
    step = base.numel() * base.element_size()
    if (
        len(parts) > 1
        and all(p.is_contiguous() and p.shape == base.shape for p in parts)
        and all(
            p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and p.data_ptr() == base.data_ptr() + i * step
            for i, p in enumerate(parts)
        )
    ):
        return base.as_strided((base.shape[0] * len(parts), *base.shape[1:]), base.stride())
    return torch.cat(parts, 0)


def _rows(n: int, rank: int, size: int) -> slice:
    if n % size:
        raise ValueError(f"dimension {n} is not divisible by tensor-parallel size {size}")
    step = n // size
    return slice(rank * step, (rank + 1) * step)


@dataclass
class Mapping:
    hf_names: tuple
    expert = False  # sharded over expert-TP and placed by expert parallelism (see Expert)

    def all_hf_names(self) -> tuple:
        """Every HF name this parameter stands for on any rank (an expert's differ between EP ranks)."""
        return self.hf_names

    def shard(self, reader: TensorReader, rank: int, size: int) -> torch.Tensor:
        raise NotImplementedError

    def unshard(self, parts: list) -> dict:
        """Full HF tensors from the TP shards in rank order."""
        raise NotImplementedError

    def gather(self, local: torch.Tensor, group=None) -> dict:
        return self.unshard(_all_gather(local, group))


class Replicated(Mapping):
    def shard(self, reader, rank, size):
        return reader.read(self.hf_names[0])

    def unshard(self, parts):
        return {self.hf_names[0]: parts[0]}

    def gather(self, local, group=None):
        return {self.hf_names[0]: local}


class Column(Mapping):
    """Split along dim 0 (ColumnParallelLinear weight/bias)."""

    def shard(self, reader, rank, size):
        return reader.read(self.hf_names[0], rows=_rows(reader.shape(self.hf_names[0])[0], rank, size))

    def unshard(self, parts):
        return {self.hf_names[0]: _cat0(parts)}


class Row(Mapping):
    """Split along dim 1 (RowParallelLinear weight)."""

    def shard(self, reader, rank, size):
        return reader.read(self.hf_names[0], cols=_rows(reader.shape(self.hf_names[0])[1], rank, size))

    def unshard(self, parts):
        return {self.hf_names[0]: torch.cat(parts, 1)}


@dataclass
class Vocab(Mapping):
    """Embedding / output layer: rows padded from vocab_size to padded_size, then split along dim 0."""

    vocab_size: int = 0
    padded_size: int = 0

    def shard(self, reader, rank, size):
        name = self.hf_names[0]
        rows = _rows(self.padded_size, rank, size)
        hidden = reader.shape(name)[1]
        if reader.shape(name)[0] != self.vocab_size:
            raise ValueError(
                f"{name}: has {reader.shape(name)[0]} rows but config.json says vocab_size="
                f"{self.vocab_size}; the config does not match the weights"
            )
        real = slice(rows.start, min(rows.stop, self.vocab_size))
        part = reader.read(name, rows=real) if real.stop > real.start else None
        out_dtype = part.dtype if part is not None else torch.float32
        out = torch.zeros(rows.stop - rows.start, hidden, dtype=out_dtype)
        if part is not None:
            out[: part.shape[0]] = part
        return out

    def unshard(self, parts):
        return {self.hf_names[0]: _cat0(parts)[: self.vocab_size]}


@dataclass
class QKV(Mapping):
    """HF q, k, v -> megatron's grouped layout [q of group g (heads/groups rows), k_g, v_g] for each group g."""

    num_heads: int = 0
    num_groups: int = 0
    head_dim: int = 0

    def shard(self, reader, rank, size):
        q, k, v = self.hf_names
        g = self.num_groups
        if g % size:
            raise ValueError(f"num_key_value_heads={g} is not divisible by tensor-parallel size {size}")
        hpg = self.num_heads // g
        expect = {q: self.num_heads * self.head_dim, k: g * self.head_dim, v: g * self.head_dim}
        for name, rows in expect.items():
            if reader.shape(name)[0] != rows:
                raise ValueError(
                    f"{name}: has {reader.shape(name)[0]} rows, expected {rows} from config.json "
                    f"(heads={self.num_heads}, kv_heads={g}, head_dim={self.head_dim})"
                )
        gl = g // size
        g0 = rank * gl
        qs = reader.read(q, rows=slice(g0 * hpg * self.head_dim, (g0 + gl) * hpg * self.head_dim))
        ks = reader.read(k, rows=slice(g0 * self.head_dim, (g0 + gl) * self.head_dim))
        vs = reader.read(v, rows=slice(g0 * self.head_dim, (g0 + gl) * self.head_dim))
        tail = qs.shape[1:]
        parts = [
            qs.reshape(gl, hpg * self.head_dim, *tail),
            ks.reshape(gl, self.head_dim, *tail),
            vs.reshape(gl, self.head_dim, *tail),
        ]
        return torch.cat(parts, 1).reshape(-1, *tail)

    def unshard(self, parts):
        full = _cat0(parts)
        hpg = self.num_heads // self.num_groups
        tail = full.shape[1:]
        grouped = full.reshape(self.num_groups, (hpg + 2) * self.head_dim, *tail)
        q, k, v = torch.split(grouped, [hpg * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return {
            self.hf_names[0]: q.reshape(-1, *tail),
            self.hf_names[1]: k.reshape(-1, *tail),
            self.hf_names[2]: v.reshape(-1, *tail),
        }


class GatedMLP(Mapping):
    """HF gate_proj, up_proj -> megatron linear_fc1 = [gate shard; up shard] on every TP rank."""

    def shard(self, reader, rank, size):
        gate, up = self.hf_names
        n = reader.shape(gate)[0]
        if reader.shape(up)[0] != n:
            raise ValueError(f"{gate} and {up} have different shapes {reader.shape(gate)} vs {reader.shape(up)}")
        rows = _rows(n, rank, size)
        return torch.cat([reader.read(gate, rows=rows), reader.read(up, rows=rows)], 0)

    def unshard(self, parts):
        halves = [p.chunk(2, dim=0) for p in parts]
        return {
            self.hf_names[0]: torch.cat([h[0] for h in halves], 0),
            self.hf_names[1]: torch.cat([h[1] for h in halves], 0),
        }


@dataclass
class Expert(Mapping):
    """One of this EP rank's local experts: megatron's local expert `local` on EP rank `ep_rank` is HF's global
    expert `ep_rank * per_rank + local` (megatron places experts in contiguous blocks). `of(e)` is global expert e's
    own mapping (GatedMLP for linear_fc1, Row for linear_fc2), sharded over the expert-TP group."""

    of: Callable = None
    local: int = 0
    per_rank: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    expert = True

    def __post_init__(self):
        self.hf_names = self.of(self.ep_rank * self.per_rank + self.local).hf_names

    def all_hf_names(self):
        return tuple(n for r in range(self.ep_size) for n in self.of(r * self.per_rank + self.local).hf_names)

    def shard(self, reader, rank, size):
        return self.of(self.ep_rank * self.per_rank + self.local).shard(reader, rank, size)

    def unshard(self, parts):
        return self.of(self.ep_rank * self.per_rank + self.local).unshard(parts)

    def unshard_ep(self, parts: list, etp: int) -> dict:
        """Full HF tensors of this local slot on every EP rank, from parts in expert-TP-and-EP group order
        (expert-TP rank fastest, as megatron's rank generator orders them)."""
        out = {}
        for r in range(len(parts) // etp):
            out.update(self.of(r * self.per_rank + self.local).unshard(parts[r * etp : (r + 1) * etp]))
        return out
