"""Padding-free micro-batches (`train.sequence_packing`; verl's use_remove_padding, ms-swift's padding_free) and
micro-batches by token budget (`train.max_tokens_per_microbatch`, verl's use_dynamic_bsz), balanced across DP.

A packed micro-batch runs the model on ONE row: its samples' tokens back to back, padded only at the end (to a
multiple of TP under SP, of 2 x CP under CP). Each token's RoPE position restarts with its sample and attention
stays inside its sample. With TransformerEngine at CP = 1 the row goes to TE's fused attention as THD sequences
(`thd_params`; models/fast_paths.attention_choice); otherwise our core attention (`models/cp_attention.py`)
attends each sample on its own (cost ~ sum of squared lengths, not the row's square), or under CP masks by segment
ids over the gathered row. Under CP the packed row is split in megatron's zigzag layout like any sequence.
The loss side does not change: the logprobs of the packed tokens are scattered back into the padded [B, L] layout
(`unpack`, differentiable), so every loss, aggregation and sequence sum sees the tensors of the padded path; under
CP the [B, L] masks keep only this rank's tokens and sequence sums all-reduce over CP as before.
"""

from __future__ import annotations

import contextlib

import torch

from mgrpo.parallel.context_parallel import split_for_cp

IGNORE_INDEX = -100


def token_cost(lengths: list, packed: bool) -> int:
    """Tokens a micro-batch of these sample lengths runs: their sum packed, rows x the longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def budget_groups(lengths: list, budget: int, packed: bool) -> list:
    """Micro-batches (lists of indices) of at most `budget` tokens each; a longer sample runs alone. Padded
    micro-batches group samples of similar length (sorted), packed ones keep the order."""
    order = list(range(len(lengths))) if packed else sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups, current = [], []
    for i in order:
        if current and token_cost([lengths[j] for j in current + [i]], packed) > budget:
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def balanced_dp_shard(lengths: list, dp_rank: int, dp_size: int) -> list:
    """This DP rank's sample indices (ascending): equal counts per rank, tokens balanced greedily, longest first."""
    if len(lengths) % dp_size:
        raise ValueError(f"{len(lengths)} samples are not divisible by data-parallel size {dp_size}")
    cap = len(lengths) // dp_size
    load, members = [0] * dp_size, [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(dp_size) if len(members[r]) < cap), key=lambda r: (load[r], r))
        load[rank] += lengths[i]
        members[rank].append(i)
    return sorted(members[dp_rank])


def pack(
    mb: dict, lengths: list, pad_id: int, multiple: int, cp_rank: int, cp_size: int, length: int | None = None
) -> None:
    """Add mb["packed"] (the model's one-row inputs) to a padded, not CP-split, micro-batch; under CP, keep only this
    rank's tokens in its [B, L] masks. `length` pads the row further (PP: one length for every micro-batch)."""
    b, width = mb["input_ids"].shape
    rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n) for n in lengths])
    total = max(len(rows), length or 0)
    total = -(-total // multiple) * multiple
    pad = total - len(rows)
    index = torch.cat([rows * width + cols, torch.full((pad,), -1, dtype=torch.long)])

    def flat(key, fill):
        return torch.cat(
            [
                mb[key].flatten()[index[: len(rows)]],
                torch.full((pad,), fill, dtype=mb[key].dtype),
            ]
        )

    packed = {
        "input_ids": flat("input_ids", pad_id),
        "targets": flat("targets", IGNORE_INDEX),
        "valid": flat("valid", False),
        "position_ids": torch.cat([cols, torch.zeros(pad, dtype=torch.long)]),
        "segments": torch.cat([rows, torch.full((pad,), b, dtype=torch.long)]),
    }  # padding: its own segment
    if "routing" in mb:
        r = mb["routing"]
        packed["routing"] = torch.cat(
            [r.flatten(0, 1)[index[: len(rows)]], torch.full((pad, *r.shape[2:]), -1, dtype=r.dtype)]
        )
    local = {k: split_for_cp(v[None], 1, cp_rank, cp_size)[0] for k, v in packed.items() if k != "segments"}
    local["index"] = split_for_cp(index[None], 1, cp_rank, cp_size)[0]
    local["rope_positions"] = packed["position_ids"]  # the whole row: megatron slices its RoPE table per CP rank
    local["segments"] = packed["segments"]  # the whole row: CP attention gathers keys of the whole row
    keep = local["index"] >= 0
    local["src"], local["dst"] = keep.nonzero().flatten(), local["index"][keep]
    local["shape"] = (b, width)
    if cp_size > 1:  # the [B, L] side keeps this rank's tokens only
        here = torch.zeros(b * width)
        here[local["dst"]] = 1.0
        here = here.view(b, width)
        for key in ("loss_mask", "token_weight", "has_rollout", "rollout_logp", "advantages"):
            mb[key] = mb[key] * here.to(mb[key].dtype)
        mb["valid"] = mb["valid"] & here.bool()
    local["attention_mask"] = None  # our core attention masks by segment and position (models/cp_attention.py)
    mb["packed"] = local


def unpack(packed: dict, x: torch.Tensor) -> torch.Tensor:
    """[1, T_local] per packed token -> [B, L] of the padded layout (zeros where this rank has no token)."""
    b, width = packed["shape"]
    out = x.new_zeros(b * width)
    return out.index_put((packed["dst"],), x[0, packed["src"]]).view(b, width)


def model_inputs(mb: dict) -> tuple:
    """(input_ids, position_ids, attention_mask) the model runs on: the packed row, else the padded batch."""
    p = mb.get("packed")
    if p is None:
        return mb["input_ids"], mb["position_ids"], mb["attention_mask"]
    return p["input_ids"][None], p["position_ids"][None], p["attention_mask"]


def thd_params(segments: torch.Tensor):
    """megatron's `PackedSeqParams` for TE's THD attention over a packed row (CP = 1): one sequence per sample, the
    padding at the end a sequence of its own (its outputs carry no loss). megatron's attention then applies RoPE per
    sequence from cu_seqlens (`rope_utils._apply_rotary_pos_emb_thd`) and TE attends within each."""
    from megatron.core.packed_seq_params import PackedSeqParams

    counts = torch.unique_consecutive(segments, return_counts=True)[1]
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=segments.device)
    cu[1:] = counts.cumsum(0)
    longest = int(counts.max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


@contextlib.contextmanager
def packed_attention(model, packed: dict):
    """While a packed row runs through `model` (a GPTModel chunk): RoPE at each token's position in its own sample
    and, for CP attention, the row's segments. Nothing for a padded micro-batch."""
    if not packed:
        yield
        return
    from mgrpo.models.cp_attention import attend_within

    with packed_rope(model, packed["rope_positions"]), attend_within(packed["segments"]):
        yield


@contextlib.contextmanager
def packed_rope(model, positions: torch.Tensor):
    """megatron builds the RoPE table for 0..S-1 of the row and slices it per CP rank; for a packed row the table is
    gathered at each token's position in its own sample first (CP slicing unchanged)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:  # learned absolute positions read position_ids
        yield
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import get_pos_emb_on_this_cp_rank

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        if max_seq_len != len(positions):
            raise ValueError(f"packed RoPE: the model asks for {max_seq_len} positions, the row has {len(positions)}")
        emb = type(rope).get_emb(rope, int(positions.max()) + 1, offset)[positions.to(rope.inv_freq.device)]
        group = cp_group if cp_group is not None else rope.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb

    rope.forward = forward  # the instance attribute shadows megatron's cached forward while this row runs
    try:
        yield
    finally:
        del rope.forward
