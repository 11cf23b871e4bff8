"""Samples -> padded micro-batches of next-token targets, masks and per-token advantages."""

from __future__ import annotations

import torch

from mgrpo.parallel.device import to_device

IGNORE_INDEX = -100


def dp_shard(items: list, dp_rank: int, dp_size: int) -> list:
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} samples are not divisible by data-parallel size {dp_size}")
    n = len(items) // dp_size
    return items[dp_rank * n : (dp_rank + 1) * n]


SEQ_KEYS = (
    "input_ids",
    "targets",
    "loss_mask",
    "advantages",
    "rollout_logp",
    "has_rollout",
    "token_weight",
    "position_ids",
    "valid",
    "routing",
)


def make_microbatches(
    samples: list,
    micro_batch_size: int,
    pad_id: int,
    advantages=None,
    pad_to_multiple: int = 1,
    same_length: bool = False,
    token_weights=None,
    cp_rank: int = 0,
    cp_size: int = 1,
    device=None,
    groups: list | None = None,
    packing: bool = False,
) -> list:
    """Each micro-batch: input_ids, position_ids, attention_mask, targets (IGNORE_INDEX off the response),
    loss_mask [b, L] aligned with the logits, advantages, rollout_logp, has_rollout (0 for samples whose
    rollout_logprobs are None: their rollout_logp is not zeros to be trusted) and token_weight [b, L] (the
    aggregation weights of `mgrpo.loss.aggregation.token_weights`), and `sample_index`.

    `same_length` pads every micro-batch to the longest one: megatron's pipeline p2p on gloo mis-pairs the
    shape exchange of variable-length micro-batches under the interleaved schedule, so PP > 1 uses it.
    With cp_size > 1 the length is padded to a multiple of 2 x cp and every per-token tensor keeps only this
    rank's zigzag chunks (targets are shifted on the full sequence first); megatron slices RoPE itself.
    Built in host memory, then each micro-batch moves to `device` in one go (the trainer's `device()`).
    `groups` (lists of sample indices, e.g. by token budget) replace the runs of `micro_batch_size`; `packing` adds
    the padding-free row the model runs on (mgrpo/data/packing.py) and leaves the [B, L] tensors unsplit under CP.
    """
    if cp_size > 1:
        pad_to_multiple = pad_to_multiple * 2 * cp_size
    out = []
    sizes = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    longest = max(sizes)
    if groups is None:
        groups = [
            list(range(k, min(k + micro_batch_size, len(samples)))) for k in range(0, len(samples), micro_batch_size)
        ]
    longest_row = max(sum(sizes[i] for i in g) for g in groups) if same_length else None
    for members in groups:
        group = [samples[i] for i in members]
        seqs = [s.prompt_ids + s.response_ids for s in group]
        length = longest if same_length and not packing else max(len(x) for x in seqs)
        length = -(-length // (1 if packing else pad_to_multiple)) * (1 if packing else pad_to_multiple)
        b = len(group)
        ids = torch.full((b, length), pad_id, dtype=torch.long)
        targets = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros(b, length)
        adv = torch.zeros(b, length)
        rollout_logp = torch.zeros(b, length)
        has_rollout = torch.zeros(b, length)  # 1 where the engine gave a logprob; never read rollout_logp elsewhere
        weight = torch.zeros(b, length, dtype=torch.float64)
        valid = torch.zeros(b, length, dtype=torch.bool)  # real tokens (prompt and response), not padding
        routing = _routing(group, length)
        for i, (s, seq) in enumerate(zip(group, seqs)):
            ids[i, : len(seq)] = torch.tensor(seq)
            valid[i, : len(seq)] = True
            r = len(s.response_ids)
            if r:  # logits at position p + j - 1 predict response token j
                span = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + r)
                on = torch.tensor(s.loss_mask, dtype=torch.bool)
                mask[i, span] = on.float()
                targets[i, span] = torch.where(on, torch.tensor(s.response_ids), IGNORE_INDEX)
                if s.rollout_logprobs is not None:
                    rollout_logp[i, span] = torch.tensor(s.rollout_logprobs) * on
                    has_rollout[i, span] = on.float()
                if token_weights is not None:
                    weight[i, span] = torch.tensor(token_weights[members[i]], dtype=torch.float64) * on
            if advantages is not None:
                adv[i] = float(advantages[members[i]])
        mb = {
            "input_ids": ids,
            "targets": targets,
            "loss_mask": mask,
            "advantages": adv * mask,
            "rollout_logp": rollout_logp,
            "has_rollout": has_rollout,
            "token_weight": weight.float(),
            "position_ids": torch.arange(length)[None].expand(b, -1).contiguous(),
            "attention_mask": torch.triu(torch.ones(length, length, dtype=torch.bool), 1)[None, None],
            "sample_index": list(members),
            "cp_size": cp_size,
            "valid": valid,
        }
        if routing is not None:
            mb["routing"] = routing
        if packing:
            from mgrpo.data.packing import pack

            pack(mb, [len(x) for x in seqs], pad_id, pad_to_multiple, cp_rank, cp_size, longest_row)
            mb["attention_mask"] = None  # the padded layout is not run; its [B, L] tensors stay whole under CP
        elif cp_size > 1:
            from mgrpo.parallel.context_parallel import split_for_cp

            for key in SEQ_KEYS:
                if key in mb:
                    mb[key] = split_for_cp(mb[key], 1, cp_rank, cp_size)
            mb["attention_mask"] = None  # CP attention masks causally by global position
        out.append(mb if device is None else to_device(mb, device))
    return out


def _routing(group: list, length: int):
    """[batch, length, moe_layers, topk] of the engine's recorded experts (-1 where none), or None if no sample of
    the micro-batch carries a record (mgrpo/models/routing.py)."""
    records = [s.routed_experts for s in group]
    if all(r is None for r in records):
        return None
    from mgrpo.models.routing import decode_routing

    shape = next(r["shape"] for r in records if r is not None)
    out = torch.full((len(group), length, shape[1], shape[2]), -1, dtype=torch.long)
    for i, r in enumerate(records):
        if r is not None:
            rows = decode_routing(r)[:length]
            out[i, : rows.shape[0]] = rows
    return out


def set_advantages(microbatches: list, advantages) -> None:
    """Fill per-token advantages once they are known (after old/ref logprobs, e.g. with KL in the reward)."""
    for mb in microbatches:
        for row, idx in enumerate(mb["sample_index"]):
            mb["advantages"][row] = float(advantages[idx]) * mb["loss_mask"][row]
