"""Plain (non-pipelined) megatron forward helpers used by tests and single-stage evaluation."""

from __future__ import annotations

import torch


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron's boolean mask convention: True marks a position that may NOT be attended."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def position_ids(batch: int, seq_len: int, device=None) -> torch.Tensor:
    return torch.arange(seq_len, device=device)[None].expand(batch, -1)


@torch.no_grad()
def full_logits(chunk, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V_local] logits of a single-stage (PP=1) model; padded vocabulary columns included."""
    b, s = input_ids.shape
    return chunk(input_ids, position_ids(b, s, input_ids.device), causal_mask(s, input_ids.device))
