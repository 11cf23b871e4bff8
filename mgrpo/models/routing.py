"""Routing replay (R3, "rollout routing replay"): the trainer's MoE layers route each token to the experts the
rollout engine chose for it.

What is replayed: the top-k expert *indices* per token and MoE layer, as the engine recorded them. The trainer's
router still computes its scores; the gate weights are its own scores gathered at the recorded experts (with
Qwen3's norm_topk_prob, a softmax over the recorded experts' logits), so the router keeps its gradient, as in R3
and megatron's own RouterReplay. Tokens the engine reported no routing for (prompt tokens an engine does not
report, the last token, padding) route freely. The engine's record covers the tokens it ran the model on: the
prompt and every response token but the last (`Sample.routed_experts`, [tokens, moe_layers, topk]).

Whether replay is on or off, every forward that carries records also measures router agreement: the share of
recorded tokens whose own top-k set equals the engine's (`moe/router_agreement`, per layer and overall).
"""
from __future__ import annotations

import base64
import contextlib

import numpy as np
import torch
import torch.distributed as dist

_ROUTES = None  # [batch, seq, moe_layers, topk] int64 of the micro-batch being run (-1: no record), or None


def encode_routing(indices) -> dict:
    """[tokens, moe_layers, topk] expert indices -> JSON-safe {"shape", "data"} (uint16 little-endian, base64)."""
    arr = np.asarray(indices, dtype="<u2")
    return {"shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}


def decode_routing(record: dict) -> torch.Tensor:
    arr = np.frombuffer(base64.b64decode(record["data"]), dtype="<u2").reshape(record["shape"])
    return torch.from_numpy(arr.astype(np.int64))


@contextlib.contextmanager
def routes_of(routes):
    """Publish the micro-batch's recorded routing while its chunk runs (set by the pipeline's forward step)."""
    global _ROUTES
    prev, _ROUTES = _ROUTES, routes
    try:
        yield
    finally:
        _ROUTES = prev


def router_order(t: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[batch, seq, ...] -> [seq * batch, ...] in megatron's token order ([seq, batch] flattened), cut to this TP
    rank's contiguous sequence chunk under sequence parallelism."""
    t = t.transpose(0, 1)
    if sequence_parallel:
        from megatron.core import parallel_state as mpu

        t = t.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return t.reshape(-1, *t.shape[2:])


def moe_routers(chunks: list):
    """(global layer index, megatron router) of every MoE layer in `chunks`."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                yield layer.layer_number - 1, router


class StepSums:
    """Per-layer float64 sums a training step accumulates while `collect()` is on; `take()` adds them over ranks."""

    def __init__(self, rows: int, cols: int):
        self.active = False
        self.sums = torch.zeros(rows, cols, dtype=torch.float64)

    @contextlib.contextmanager
    def collect(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def take(self, group=None) -> torch.Tensor:
        """The step's sums over `group` (a collective; default the world); counting starts again from zero."""
        sums = self.sums.clone()
        self.sums.zero_()
        if dist.is_initialized():
            dist.all_reduce(sums, group=group)
        return sums


class RecordedTopK:
    """Stands in for megatron's per-router `RouterReplay` (the router passes it to its top-k): the router's own
    top-k, then, where the engine recorded this token's experts, those experts (replay on) or only the agreement
    count (replay off)."""

    def __init__(self, state: "RoutingReplay", layer: int, ordinal: int):
        self.state, self.layer, self.ordinal = state, layer, ordinal

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if _ROUTES is None:
            return probs, idx
        rec = router_order(_ROUTES[:, :, self.ordinal], self.state.sp).to(idx.device)
        has = rec[:, 0] >= 0
        if self.state.active:
            same = (idx[has].sort(-1).values == rec[has].sort(-1).values).all(-1)
            self.state.sums[self.layer] += torch.tensor([float(same.sum()), float(has.sum())], dtype=torch.float64)
        if not self.state.replay:
            return probs, idx
        idx = torch.where(has[:, None], rec, idx)
        return scores.gather(1, idx), idx


class RoutingReplay(StepSums):
    """Installs RecordedTopK on every MoE router of `chunks`; `collect()` counts agreement, `reduce()` reports it."""

    def __init__(self, chunks: list, info, replay: bool, sequence_parallel: bool):
        super().__init__(info.num_hidden_layers, 2)
        self.replay, self.sp = replay, sequence_parallel
        for g, router in moe_routers(chunks):
            router.router_replay = RecordedTopK(self, g, sum(info.moe.sparse_layers[:g]))

    def reduce(self, group=None) -> dict:
        out, agree, total = {}, 0.0, 0.0
        for g, (same, n) in enumerate(self.take(group).tolist()):
            if n:
                out[f"moe/layer_{g:02d}/router_agreement"] = same / n
                agree, total = agree + same, total + n
        if total:
            out["moe/router_agreement"] = agree / total
        return out
