"""The top-entropy token mask: only the tokens whose entropy lies in the top `q` of the mini-batch's loss tokens keep
their policy-gradient term (`algorithm.top_entropy_quantile`; ms-swift's `--top_entropy_quantile`, after Wang et
al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM
Reasoning", arXiv:2506.01939, which trains on the top 20%).

The threshold is the `1 - q` quantile (linear interpolation, as `torch.quantile` and TRL/ms-swift's
`get_high_entropy_mask`) of the entropies of every loss token of the mini-batch, gathered across DP x CP, so it
does not depend on how the batch is split over ranks or micro-batches: DP2 and CP2 mask exactly what one device
masks. (ms-swift gathers per micro-batch across processes, which makes the mask depend on the micro-batch split.)
A token is kept when its entropy is >= the threshold. The entropies are those of the policy that computed the
old logprobs, in the same fused-kernel pass (`Actor.logprobs(..., entropy=True)`): with one update per rollout
that is the policy being trained; with several, the mask stays fixed over them (the rollout policy's forking
tokens). Masked tokens get advantage 0: their policy term vanishes, the KL term and the aggregation's token counts
stay as they are (TRL's order: the mask multiplies the policy term only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def linear_quantile(values: torch.Tensor, q: float) -> float:
    """`torch.quantile(values, q)` (linear interpolation) for any size (torch's refuses inputs over 2^24)."""
    v = values.double().flatten().sort().values
    if v.numel() == 0:
        return float("-inf")
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def gather_variable(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D `local` (any lengths), concatenated in rank order, on every rank of `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    n = torch.tensor([local.numel()], dtype=torch.long, device=local.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


def entropy_threshold(microbatches: list, q: float, group) -> float:
    """The `1 - q` quantile of the loss tokens' `entropy` over these micro-batches on every rank of `group`."""
    local = [mb["entropy"][mb["loss_mask"] > 0].float() for mb in microbatches]
    local = torch.cat(local) if local else torch.zeros(0)
    return linear_quantile(gather_variable(local, group), 1.0 - q)


def set_entropy_masks(microbatches: list, q: float, group) -> float:
    """`mb["entropy_mask"]` (1 = keeps its policy term) on each micro-batch holding `entropy` (last-stage ranks);
    returns the threshold. A collective over `group` (the DP x CP group): its ranks all call it."""
    threshold = entropy_threshold(microbatches, q, group)
    for mb in microbatches:
        keep = (mb["entropy"].double() >= threshold) & (mb["loss_mask"] > 0)
        mb["entropy_mask"] = keep.to(mb["loss_mask"].dtype)
    return threshold
