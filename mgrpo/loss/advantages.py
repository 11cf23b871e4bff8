"""Outcome advantages from per-sample rewards and group ids: ``fn(rewards [N], group_ids [N], cfg) -> [N]`` float32.

Estimators (ms-swift ``advantage_estimator``; modelscope/ms-swift, swift/trainers/rlhf_trainer/grpo_trainer.py
``_compute_advantages`` L481-575):

- ``grpo``: ``A_i = r_i - mean_g(r)``.
- ``rloo``: leave-one-out baseline, ``A_i = r_i - mean_{j != i, j in g}(r_j) = (r_i - mean_g(r)) * K / (K - 1)``
  with ``K`` the number of valid members of the group.
- ``reinforce_plus_plus``: ms-swift's variant of outcome-only REINFORCE++-baseline, NOT the paper's: the same group
  baseline as ``grpo``, ``A_i = r_i - mean_g(r)``, but the scale is the std of the *advantages* (not of the raw
  rewards): with ``scale_rewards='batch'`` (its default) that is ``A / (std_batch(A) + eps)``, i.e. batch-whitened
  group-centred rewards (``mean_batch(A)`` is exactly 0 because every group's centred rewards sum to 0, so nothing
  is subtracted). With ``'group'`` the group std of ``A`` equals the group std of ``r``; ``'none'`` leaves ``A``.
  It normalises over SAMPLES; the REINFORCE++ paper and verl whiten over TOKENS (next item).
- ``reinforce_plus_plus_baseline``: the paper's and verl's (``compute_reinforce_plus_plus_baseline_outcome_advantage``)
  token-level whitening: ``A_i = r_i - mean_g(r)`` is given to each of the sample's loss tokens, then whitened over
  all loss tokens of the batch, ``(A - mean_tok(A)) / sqrt(var_tok(A) + 1e-8)`` with the unbiased token variance
  (verl's ``masked_whiten``): a long response weighs in the statistics by its length. It needs the per-sample loss
  token counts (``lengths``); ``scale_rewards`` does not apply (the whitening is its scale). Unlike verl, a group
  with one valid member gets ``A_i = 0`` before whitening (verl subtracts 0 there), like our other estimators.

Scaling (``cfg.scale_rewards``): ``group`` divides by the group's std of rewards, ``batch`` by the std of all valid
rewards of the batch (``reinforce_plus_plus``: std of all valid advantages), ``none`` does not scale; ``None`` (or the
attribute missing) picks the estimator's ms-swift default from ``DEFAULT_SCALE_REWARDS``. Stds are unbiased (``n-1``,
like ``torch.std``) and the divisor is ``std + STD_EPS`` with ``STD_EPS = 1e-4`` as in ms-swift.

Invalid rewards (NaN or +-inf) get advantage 0 and are left out of every statistic (group means, stds, counts, batch
std). ``valid_mask(rewards)`` tells the caller which samples those are, so it can zero their loss mask: an advantage
of 0 alone still leaves them in the token counts of the aggregation. A group with a single valid member gets
advantage 0 (there is no baseline), never NaN; a group whose rewards are all equal gets 0 as well.

Statistics are computed in float64 over the whole (global) batch the caller passes; the result is float32.
"""

from __future__ import annotations

import inspect

import torch

from mgrpo.loss.registry import advantages, register_advantage

STD_EPS = 1e-4  # ms-swift: advantages / (std + 1e-4)

# ms-swift binds the default of scale_rewards to the estimator (used when cfg.scale_rewards is None).
DEFAULT_SCALE_REWARDS = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
SCALE_REWARDS = ("group", "batch", "none")


def valid_mask(rewards) -> torch.Tensor:
    """bool [N]: True where the reward is finite. Invalid samples get advantage 0 and should get loss mask 0."""
    return torch.isfinite(torch.as_tensor(rewards, dtype=torch.float64))


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample (mean, unbiased std, valid count) of its group over the valid members only, plus the valid mask.

    The std of a group with fewer than 2 valid members is 0.
    """
    valid = valid_mask(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    w = valid.to(r.dtype)
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, w)
    total = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, r * w)
    mean = total / count.clamp_min(1)
    sq = torch.zeros(len(uniq), dtype=r.dtype).index_add_(0, inv, ((r - mean[inv]) ** 2) * w)
    std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp_min(1)), torch.zeros_like(sq))
    return mean[inv], std[inv], count[inv], valid


def _batch_std(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unbiased std of x over the valid entries (0 when fewer than 2)."""
    n = int(valid.sum())
    if n < 2:
        return torch.zeros((), dtype=x.dtype)
    return x[valid].std()


def _scale_mode(cfg, estimator: str) -> str:
    mode = getattr(cfg, "scale_rewards", None)
    if mode is None:
        mode = DEFAULT_SCALE_REWARDS[estimator]
    if mode is True:  # ms-swift < 3.10 booleans
        mode = "group"
    elif mode is False:
        mode = "none"
    if mode not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} (or None), got {mode!r}")
    return mode


def _inputs(rewards, group_ids):
    rewards = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    group_ids = torch.as_tensor(group_ids).reshape(-1)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} differ in length")
    return rewards, group_ids


def _finish(adv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0).float()


def _scale(adv, mode: str, group_std, batch_source, valid):
    """Divide by the group std, by the std of `batch_source` over the valid batch, or not at all."""
    if mode == "group":
        return adv / (group_std + STD_EPS)
    if mode == "batch":
        return adv / (_batch_std(batch_source, valid) + STD_EPS)
    return adv


@register_advantage("grpo")
def grpo(rewards, group_ids, cfg):
    """(r - group mean) / (std + 1e-4), std by cfg.scale_rewards: group | batch (of rewards) | none.

    Groups with one valid member, equal rewards and invalid (NaN/inf) rewards give 0.
    """
    rewards, group_ids = _inputs(rewards, group_ids)
    mean, std, count, valid = _group_stats(rewards, group_ids)
    ok = valid & (count > 1)
    adv = torch.where(ok, rewards - mean, torch.zeros_like(rewards))
    return _finish(_scale(adv, _scale_mode(cfg, "grpo"), std, rewards, valid), ok)


@register_advantage("rloo")
def rloo(rewards, group_ids, cfg):
    """Leave-one-out: r_i - mean of the other valid members of its group = (r_i - mean) * K/(K-1).

    Then scaled like ``grpo`` (by the std of the rewards) according to cfg.scale_rewards (ms-swift's default for rloo
    is 'none'). A group with one valid member gives 0.
    """
    rewards, group_ids = _inputs(rewards, group_ids)
    mean, std, count, valid = _group_stats(rewards, group_ids)
    ok = valid & (count > 1)
    k = count.clamp_min(2)
    adv = torch.where(ok, (rewards - mean) * k / (k - 1), torch.zeros_like(rewards))
    return _finish(_scale(adv, _scale_mode(cfg, "rloo"), std, rewards, valid), ok)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(rewards, group_ids, cfg):
    """REINFORCE++-baseline (outcome rewards): A = r - group mean, scaled by the std of A.

    cfg.scale_rewards: batch (ms-swift default: std of A over all valid samples of the batch, including the zero
    advantages of single-member groups), group (std of A in the group, = std of r), none.
    """
    rewards, group_ids = _inputs(rewards, group_ids)
    mean, std, count, valid = _group_stats(rewards, group_ids)
    ok = valid & (count > 1)
    adv = torch.where(ok, rewards - mean, torch.zeros_like(rewards))
    return _finish(_scale(adv, _scale_mode(cfg, "reinforce_plus_plus"), std, adv, valid), ok)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(rewards, group_ids, cfg, lengths=None):
    """verl's REINFORCE++-baseline: group-centred rewards whitened over loss tokens (each sample weighs by its
    `lengths` entry, its number of loss tokens; all 1 when None)."""
    rewards, group_ids = _inputs(rewards, group_ids)
    mean, _, count, valid = _group_stats(rewards, group_ids)
    ok = valid & (count > 1)
    adv = torch.where(ok, rewards - mean, torch.zeros_like(rewards))
    w = torch.ones_like(rewards) if lengths is None else torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    w = torch.where(valid, w, torch.zeros_like(w))
    tokens = w.sum()
    if tokens < 2:
        return _finish(torch.zeros_like(adv), valid)
    mu = (w * adv).sum() / tokens
    var = (w * (adv - mu) ** 2).sum() / tokens * tokens / (tokens - 1)
    return _finish((adv - mu) * torch.rsqrt(var + 1e-8), valid)


def compute_advantages(name: str, rewards, group_ids, cfg, lengths=None):
    """Call estimator `name`, passing the per-sample loss token counts to those that take `lengths`."""
    fn = advantages(name)
    if lengths is not None and "lengths" in inspect.signature(fn).parameters:
        return fn(rewards, group_ids, cfg, lengths=lengths)
    return fn(rewards, group_ids, cfg)
