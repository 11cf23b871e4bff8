"""Context parallelism (CP) helpers: megatron's load-balanced ("zigzag") sequence layout, explicit CP groups.

Layout (megatron-core's `get_batch_on_this_cp_rank`, RoPE's `get_pos_emb_on_this_cp_rank`, TE's CP attention):
a sequence of length S (S % (2*cp) == 0) is cut into 2*cp equal chunks; CP rank r holds chunks r and
2*cp-1-r, concatenated in that order. Example S=8, cp=2: rank 0 holds positions [0 1 6 7], rank 1 [2 3 4 5].

Everything here takes the CP rank/size or the CP group EXPLICITLY. megatron-core 0.19 changed
`get_batch_on_this_cp_rank(batch, cp_group=None)` so that None means WORLD; we never rely on such defaults.

RoPE under CP in megatron-core 0.16.1 (checked in tests/parallel/test_cp_attention.py): GPTModel ignores
`position_ids` for `position_embedding_type="rope"` (they only feed learned absolute position embeddings).
Its `_preprocess` computes `rotary_seq_len = local_len * context_parallel_size` (times TP under sequence
parallelism), builds the FULL-length RoPE table and slices it itself with `get_pos_emb_on_this_cp_rank`
(zigzag chunks r and 2*cp-1-r). So the caller must feed `input_ids` (and labels, loss masks, old logprobs, ...)
ALREADY zigzag-split with `split_for_cp(..., seq_dim=1, ...)`, of local length S/cp; position ids may be the
zigzag ones (`cp_position_ids`) for clarity, but GPTModel does not read them with RoPE.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


def _check_len(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if seq_len % (2 * cp_size) != 0 and cp_size > 1:
        raise ValueError(
            f"context parallelism needs the sequence length divisible by 2*cp = {2 * cp_size}, got {seq_len}; "
            f"pad sequences to a multiple of {2 * cp_size}"
        )


def zigzag_indices(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.LongTensor:
    """Global positions held by `cp_rank`, in local order: chunk cp_rank then chunk 2*cp_size-1-cp_rank."""
    _check_len(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def cp_position_ids(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.LongTensor:
    """Position ids of the local tokens (== zigzag_indices). Not read by megatron's GPTModel with RoPE, which
    slices its own full-length RoPE table per CP rank; useful for our own code (masks, logging)."""
    return zigzag_indices(seq_len, cp_rank, cp_size, device=device)


def split_for_cp(tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's zigzag slice of `tensor` along `seq_dim` (a copy; any dtype, any number of dims)."""
    if cp_size == 1:
        return tensor
    seq_len = tensor.shape[seq_dim]
    _check_len(seq_len, cp_size)
    idx = zigzag_indices(seq_len, cp_rank, cp_size, device=tensor.device)
    return tensor.index_select(seq_dim, idx)


def _group_rank_size(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def rank_major_positions(seq_len: int, cp_size: int, device=None) -> torch.LongTensor:
    """Global position of each row of the rank-major concatenation [rank0 local | rank1 local | ...]."""
    return torch.cat([zigzag_indices(seq_len, r, cp_size, device=device) for r in range(cp_size)])


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every CP rank's local tensor along `seq_dim` in rank order (rank-major, NOT global order).

    Backward contract: each rank's loss term used the gathered tensor, and the caller's parameter gradients are
    summed over the CP group (megatron DDP reduces over DP x CP), so the gradient of this rank's slice is the sum
    over ranks of their incoming gradients at that slice: all_reduce(SUM) then slice (gloo has no reduce_scatter).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ctx.seq_dim, ctx.group, ctx.rank, ctx.local_len = seq_dim, group, rank, local.shape[seq_dim]
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()  # all_reduce works in place: never touch autograd's buffer
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        mine = total.narrow(ctx.seq_dim, ctx.rank * ctx.local_len, ctx.local_len)
        return mine.contiguous(), None, None


def all_gather_seq_rank_major(local: torch.Tensor, seq_dim: int, group) -> torch.Tensor:
    """Differentiable all-gather along `seq_dim` (rank-major order); see `_AllGatherSeq` for the grad contract."""
    return _AllGatherSeq.apply(local, seq_dim, group)


def gather_from_cp(local: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Full sequence in original (global) order from every CP rank's zigzag slice (for tests and logging).

    Differentiable with the same contract as `_AllGatherSeq` (gradients summed over CP ranks).
    """
    rank, size = _group_rank_size(cp_group)
    if size == 1:
        return local
    gathered = all_gather_seq_rank_major(local, seq_dim, cp_group)
    seq_len = gathered.shape[seq_dim]
    pos = rank_major_positions(seq_len, size, device=local.device)
    inverse = torch.empty_like(pos)
    inverse[pos] = torch.arange(seq_len, device=local.device)
    return gathered.index_select(seq_dim, inverse)


class _CPSum(torch.autograd.Function):
    """y = sum over the CP group of x (all_reduce SUM); the result is replicated on every CP rank.

    Gradient contract: the objective is J = sum_k L_k, where L_k is CP rank k's loss (this is what the
    parameter-gradient reduction over DP x CP computes, up to a constant factor that the caller owns). Every L_k
    may use y, so dJ/dx_r = sum_k dL_k/dy: backward all-reduces (SUM) the incoming gradient.
    Consequence for callers: a term that every rank computes identically from y alone (e.g. a per-sequence
    penalty g(y) added on every CP rank) is counted cp times in J; put it on one CP rank or divide it by cp.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def cp_seq_sum(cp_group) -> Callable[[torch.Tensor], torch.Tensor]:
    """`f(x[B, L_local]) -> [B]`: per-row sum over the whole sequence, i.e. over every CP rank's local tokens.

    The result is replicated on every CP rank and differentiable with the contract of `_CPSum`: the gradient wrt
    the local x_r is the gradient of the TOTAL loss sum_k L_k (L_k = CP rank k's loss), which is right when each
    rank's loss holds only its own tokens' terms (e.g. sum_t l_t / f(mask) for sequence-mean aggregation).
    With `cp_group` None or of size 1 it is plain `x.sum(-1)`.
    """
    if _group_rank_size(cp_group)[1] == 1:
        return lambda x: x.sum(-1)

    def f(x: torch.Tensor) -> torch.Tensor:
        return _CPSum.apply(x.sum(-1), cp_group)

    return f


def cp_rank_size(cp_group: Optional[object] = None) -> tuple[int, int]:
    """(rank, size) in `cp_group`; (0, 1) for None or without torch.distributed."""
    return _group_rank_size(cp_group)
