"""Core attention with context parallelism (CP) that needs no TransformerEngine (CPU / gloo, or GPUs without TE).

megatron-core 0.16.1's local `DotProductAttention` asserts `context_parallel_size == 1`. `CPDotProductAttention`
has the same constructor and forward signatures and drops into the local layer spec:

    spec.submodules.self_attention.submodules.core_attention = CPDotProductAttention

Inputs are this CP rank's tokens in megatron's zigzag layout (see mgrpo/parallel/context_parallel.py): q, k, v of
shape [s_local, b, heads_local, head_dim] (k/v with query-group heads under GQA), output [s_local, b,
heads_local * head_dim]. K and V are all-gathered over the CP group (differentiable: the backward all-reduces
the K/V gradients and keeps this rank's slice), put back in global order, repeated per query group (GQA) and
attended with a causal mask built from global positions: the query at global position i sees key j iff j <= i.
Softmax runs in fp32 with scale 1/sqrt(head_dim) (or the given softmax_scale).

`attention_mask` is ignored: masking is causal by position only (and, for a packed row, within each sample: see
`attend_within`). That is exact for our batches, whose padding
sits at the end of each sequence (real tokens never attend to later pad tokens; pad outputs are masked out of
the loss). megatron's THD packing (`packed_seq_params`), attention bias, sliding windows and non-vanilla softmax are
not supported and raise. The CP group comes from `cp_group`, else `pg_collection.cp`, else megatron's
parallel_state CP group; never WORLD. `cp_comm_type` is accepted for signature compatibility and ignored (this
is always all-gather K/V). Memory is O(s_local * S) scores per head: fine for the sizes we train on CPU.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from mgrpo.parallel.context_parallel import (
    all_gather_seq_rank_major,
    cp_rank_size,
    rank_major_positions,
    zigzag_indices,
)

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
_SEGMENTS: Optional[Tensor] = None  # the packed row's sample of each global position (mgrpo/data/packing.py)


@contextlib.contextmanager
def attend_within(segments: Optional[Tensor]):
    """While a packed row runs: each query attends only to keys of its own segment (sample)."""
    global _SEGMENTS
    previous, _SEGMENTS = _SEGMENTS, segments
    try:
        yield
    finally:
        _SEGMENTS = previous


class CPDotProductAttention(MegatronModule):
    """Drop-in core attention for megatron's local spec that supports context parallelism (see module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # ignored: always all-gather K/V

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = getattr(pg_collection, "tp", None)
        if self.tp_group is None:
            self.tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        if cp_group is None:
            cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_group = cp_group
        _, cp_size = cp_rank_size(cp_group)
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"CP group has {cp_size} ranks but config.context_parallel_size is "
                f"{config.context_parallel_size}; pass the right cp_group / pg_collection"
            )

        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None else softmax_scale
        )
        self.coeff = None
        if config.apply_query_key_layer_scaling:  # same product as megatron: scale / layer, then * layer in fp32
            self.coeff = self.layer_number
            self.softmax_scale /= self.coeff

        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("CPDotProductAttention does not support sliding-window attention")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"CPDotProductAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """q [sq, b, np, hn], k/v [sq, b, ng, hn] (this CP rank's zigzag tokens) -> [sq, b, np * hn].

        `attention_mask` is ignored (causal masking by global position; see the module docstring).
        """
        if packed_seq_params is not None:
            raise NotImplementedError("CPDotProductAttention does not support packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("CPDotProductAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _CAUSAL_TYPES:
            raise NotImplementedError(f"CPDotProductAttention is causal only, got attn_mask_type={mask_type}")

        sq, b, n_heads, head_dim = query.shape
        cp_rank, cp_size = cp_rank_size(self.cp_group)
        seq_len = sq * cp_size
        device = query.device
        if cp_size > 1:
            # [sq, b, ng, hn] on each rank -> [S, b, ng, hn] rank-major -> global order
            key = all_gather_seq_rank_major(key, 0, self.cp_group)
            value = all_gather_seq_rank_major(value, 0, self.cp_group)
            held = rank_major_positions(seq_len, cp_size, device=device)
            order = torch.empty_like(held)
            order[held] = torch.arange(seq_len, device=device)
            key = key.index_select(0, order)
            value = value.index_select(0, order)
            q_pos = zigzag_indices(seq_len, cp_rank, cp_size, device=device)
        else:
            q_pos = torch.arange(sq, device=device)
        k_pos = torch.arange(seq_len, device=device)
        if key.size(0) != seq_len:
            raise ValueError(f"key length {key.size(0)} != query length {sq} x cp {cp_size}")

        groups = key.size(2)
        if n_heads % groups:
            raise ValueError(f"{n_heads} query heads are not a multiple of {groups} key/value groups")
        if n_heads > groups:  # GQA: megatron repeats each K/V group for its consecutive query heads
            key = key.repeat_interleave(n_heads // groups, dim=2)
            value = value.repeat_interleave(n_heads // groups, dim=2)

        if _SEGMENTS is not None and cp_size == 1:  # a packed row on one rank: each sample on its own
            return torch.cat(
                [
                    self._attend(query[a:e], key[a:e], value[a:e], q_pos[: e - a], k_pos[: e - a])
                    for a, e in _runs(_SEGMENTS)
                ]
            )
        blocked = None
        if _SEGMENTS is not None:  # a packed row split over CP: only keys of the query's own sample
            seg = _SEGMENTS.to(device)
            blocked = seg[None, :] != seg[q_pos][:, None]
        return self._attend(query, key, value, q_pos, k_pos, blocked)

    def _attend(self, query, key, value, q_pos, k_pos, blocked=None) -> Tensor:
        """Causal attention of queries at q_pos over keys at k_pos ([sq, b, np, hn] each, K/V already per head)."""
        sq, b, n_heads, head_dim = query.shape
        # [b, np, sq, hn] x [b, np, hn, S] -> [b, np, sq, S]
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * self.softmax_scale
        scores = scores.float()
        if self.coeff is not None:
            scores = scores * self.coeff
        later = k_pos[None, :] > q_pos[:, None]  # [sq, S]: True = may not attend
        scores = scores.masked_fill(later if blocked is None else later | blocked, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)

        if self.attention_dropout.p > 0 and self.training:
            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)

        # [b, np, sq, S] x [b, np, S, hn] -> [b, np, sq, hn] -> [sq, b, np * hn]
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))
        return context.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)


def _runs(segments: Tensor) -> list:
    """[(start, end)] of the runs of equal segment ids (a packed row's samples, then its padding)."""
    change = (segments[1:] != segments[:-1]).nonzero().flatten().add(1).tolist()
    edges = [0, *change, len(segments)]
    return list(zip(edges[:-1], edges[1:]))
