"""Per-token policy losses. Each returns (per_token_loss, metrics) and leaves aggregation to the caller."""
from __future__ import annotations

import torch

from mgrpo.loss.registry import register_policy_loss


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1)


@register_policy_loss("ppo_clip")
def ppo_clip(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None):
    """PPO clipped surrogate: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - old_logp)."""
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    loss = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": _masked_mean(0.5 * log_ratio.pow(2), mask),
        }
    return loss * mask, metrics
