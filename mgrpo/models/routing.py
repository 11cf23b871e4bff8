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


NO_RECORD = 0xFFFF  # a token the record has no experts for (it routes freely); decodes to -1


def encode_routing(indices) -> dict:
    """[tokens, moe_layers, topk] expert indices (-1: no record) -> JSON-safe {"shape", "data"} (uint16
    little-endian, base64)."""
    arr = np.asarray(indices).astype(np.int64)
    arr = np.where(arr < 0, NO_RECORD, arr).astype("<u2")
    return {"shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}


def decode_routing(record: dict) -> torch.Tensor:
    arr = np.frombuffer(base64.b64decode(record["data"]), dtype="<u2").reshape(record["shape"]).astype(np.int64)
    return torch.from_numpy(np.where(arr == NO_RECORD, -1, arr))


def merge_turn_routing(ids: list, turns: list) -> dict | None:
    """One trajectory's record from its engine calls: `ids` is the whole trajectory (prompt + every turn's tokens,
    environment tokens included), `turns` the calls in order as (input ids, generated ids, the call's record of
    input + generated[:-1]). Row p (the experts of token p, which decide the distribution of token p + 1) comes
    from the turn that generated token p + 1 (its decode-time routing, what the sample was drawn with), else from
    the latest turn that ran token p as input (a later turn's prefill: environment tokens, the prompt). A turn's
    row counts only while the turn's tokens up to p are the trajectory's (a scheduler may rewrite a turn's tokens);
    rows no turn covers are -1 (free routing). None when no turn carries a record."""
    n, out, owned = len(ids) - 1, None, None
    for inputs, generated, record in turns:
        if record is None:
            continue
        rows = decode_routing(record)
        if out is None:
            out = torch.full((max(n, 0), *rows.shape[1:]), -1, dtype=torch.long)
            owned = torch.zeros(max(n, 0), dtype=torch.bool)
        seq, same = list(inputs) + list(generated), 0
        while same < min(len(seq), len(ids)) and seq[same] == ids[same]:
            same += 1
        valid = min(rows.shape[0], same, n)
        if valid <= 0:
            continue
        decoded = torch.arange(valid) >= len(inputs) - 1  # rows whose next token this turn sampled
        take = decoded | ~owned[:valid]
        out[:valid][take] = rows[:valid][take]
        owned[:valid] |= decoded
    return None if out is None else encode_routing(out.numpy())


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

    @contextlib.contextmanager
    def replay_off(self):
        """The routers route on their own while this is on (agreement is still measured)."""
        prev, self.replay = self.replay, False
        try:
            yield
        finally:
            self.replay = prev

    def reduce(self, group=None) -> dict:
        out, agree, total = {}, 0.0, 0.0
        for g, (same, n) in enumerate(self.take(group).tolist()):
            if n:
                out[f"moe/layer_{g:02d}/router_agreement"] = same / n
                agree, total = agree + same, total + n
        if total:
            out["moe/router_agreement"] = agree / total
        return out
