"""Outcome advantages from per-sample rewards and group ids."""
from __future__ import annotations

import torch

from mgrpo.loss.registry import register_advantage


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample mean and (unbiased) std of its group, over the non-NaN members only."""
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, valid.to(r.dtype))
    total = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, r)
    mean = total / count.clamp_min(1)
    sq = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, torch.where(valid, (r - mean[inv]) ** 2, 0 * r))
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return mean[inv], std[inv], count[inv], valid


@register_advantage("grpo")
def grpo(rewards, group_ids, cfg):
    """(r - group mean) / std, std by cfg.scale_rewards: group | batch | none. Groups of 1 and NaN give 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = torch.as_tensor(group_ids)
    mean, std, count, valid = _group_stats(rewards, group_ids)
    adv = torch.where(valid & (count > 1), rewards - mean, torch.zeros_like(rewards))
    if cfg.scale_rewards == "group":
        adv = adv / (std + 1e-6)
    elif cfg.scale_rewards == "batch":
        adv = adv / (rewards[valid].std() + 1e-6 if valid.sum() > 1 else 1.0)
    return torch.nan_to_num(adv, nan=0.0).float()
