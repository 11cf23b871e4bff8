"""Per-token policy losses: ``fn(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None,
seq_sum=None) -> (per_token_loss [B, L], metrics)``.

Tensors are ``[B, L]`` (rows are sequences, padded; ``mask`` is 0/1). ``advantages`` may be ``[B, L]`` (per token, as
the micro-batches carry them) or ``[B]``. The returned loss is already multiplied by the mask and NOT aggregated:
token-mean / seq-mean-token-mean / seq-mean-token-sum-norm is applied by the caller from global counts. ``metrics``
holds 0-dim detached tensors, masked means over this micro-batch's tokens.

``seq_sum`` maps a ``[B, L]`` tensor to its per-row sum ``[B]``; default ``x.sum(-1)``. Under context parallelism the
caller passes a differentiable all-reduce over the CP ranks, and every sequence-level quantity here (the GSPO
sequence ratio: both its numerator and its token count) goes through it.

Per-token loss = ``w * policy term + kl_coef * k(logp, ref_logp)`` with ``w`` the (detached) ``rollout_is_weights``
when given (else 1), the KL term when ``ref_logp`` is given, ``cfg.kl_coef != 0`` and not ``cfg.kl_in_reward`` (``k`` is
``cfg.kl_estimator``, default k3 as ms-swift). The IS weight corrects the sampling distribution of the policy
gradient, not the penalty against the reference: verl multiplies ``pg_losses`` by ``rollout_is_weights`` inside each
policy loss (``verl/trainer/ppo/core_algos.py``, e.g. ``compute_policy_loss_vanilla``) and adds
``kl_loss * kl_loss_coef`` afterwards, unweighted (``verl/workers/actor/dp_actor.py``, ``megatron_actor.py``).
ms-swift multiplies both (``_compute_loss_and_metrics`` L1205-1238); we follow verl.

Each loss declares the aggregation it is defined with (``DEFAULT_AGGREGATION``), used when ``cfg.aggregation`` is
unset: GSPO is a sequence-level objective (arXiv:2507.18071 eq. 5: a mean over the group's sequences of a
length-normalised sequence term), and verl's ``compute_policy_loss_gspo`` hard-codes ``seq-mean-token-mean``.

Losses (ratio ``r = pi_theta / pi_old``; as in ms-swift's GRPO trainer, modelscope/ms-swift, swift/trainers/rlhf_trainer/grpo_trainer.py):

- ``ppo_clip``: ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``; dual clip (opt-in): where ``A < 0`` the loss is
  further capped at ``-A * clip_ratio_c`` (``cfg.clip_ratio_c``; default None = off, as ms-swift's ``delta``; verl's
  value is 3.0, ``DUAL_CLIP_VERL``). ms-swift's ``delta`` (``coef_1 = clamp(coef_1, max=delta)``) is the same thing
  for ``delta > 1 + eps_high``. When set it applies to ``gspo`` and ``gspo_token`` too (the GSPO paper has none).
- ``gspo``: sequence-level ratio ``s_i = exp(mean over the row's tokens of (logp - old_logp))`` in place of ``r``,
  the same clipped surrogate, with GSPO's epsilons (3e-4 / 4e-4) by default.
- ``gspo_token``: GSPO-token, ratio ``sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]``: its value is ``s_i`` and its
  gradient is per token (lets per-token advantages through).
- ``cispo``: ``-sg[min(r, eps_high)] * A * logp``; ``eps_high`` is an absolute cap on the detached token ratio
  (default 5.0, ms-swift's recommendation after ScaleRL), ``eps_low`` is not used. The clipped ratio is a weight, so
  every token keeps the REINFORCE gradient ``-w A grad logp``. Its ``clip_frac`` counts every token whose ratio
  was capped (verl counts any clipped token, whatever A's sign); ``cispo_clip_frac_pos`` those with ``A > 0``
  (ms-swift's count).
- ``sapo`` (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv:2511.20347; ms-swift's ``loss_type sapo``,
  ``--tau_pos/--tau_neg``): ``-f(r; tau) A`` with the soft gate ``f(r; tau) = sigmoid(tau (r - 1)) 4 / tau`` in
  place of the hard clip, ``tau = cfg.tau_pos`` where ``A > 0`` and ``cfg.tau_neg`` where ``A < 0`` (defaults 1.0 /
  1.05: negative advantages decay faster). ``df/dr = 4 s (1 - s)`` with ``s = sigmoid(tau (r - 1))`` is 1 at
  ``r = 1``, so on-policy it is the plain policy gradient; off-policy tokens are attenuated smoothly, never cut.
  No epsilons. Its ``clip_frac`` is the share of tokens whose gradient weight ``4 s (1 - s)`` is below 1/2.

The log ratio is clamped to ``[-20, 20]`` before ``exp`` (verl's bound), so a token with advantage 0 and a huge
ratio gives 0, never ``0 * inf = NaN``; where the clamp is active the token has no gradient through the ratio.

Epsilons: ``cfg.epsilon_low`` / ``cfg.epsilon_high``; a value of None takes the loss's default from
``DEFAULT_EPSILONS``.
"""

from __future__ import annotations

import torch

from mgrpo.loss.kl import kl_penalty
from mgrpo.loss.registry import register_policy_loss

# (epsilon_low, epsilon_high) used when cfg's value is None. cispo: eps_high is an absolute cap on the ratio.
DEFAULT_EPSILONS = {
    "ppo_clip": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "cispo": (None, 5.0),
    "sapo": (None, None),  # no clip: the gate's temperatures are cfg.tau_pos / cfg.tau_neg
}
# The aggregation each loss is defined with, used when cfg.aggregation is None (see the module docstring).
DEFAULT_AGGREGATION = {
    "ppo_clip": "token-mean",  # DAPO's token-level loss, verl's default loss_agg_mode
    "gspo": "seq-mean-token-mean",  # GSPO paper eq. 5; verl compute_policy_loss_gspo
    "gspo_token": "seq-mean-token-mean",
    "cispo": "token-mean",  # MiniMax-M1 (arXiv:2506.13585) eq. 4 normalises by the batch's tokens
    "sapo": "seq-mean-token-mean",  # ms-swift's loss_type sapo (the grpo normalisation)
}
DUAL_CLIP_VERL = 3.0  # verl's clip_ratio_c; ours is off unless cfg.clip_ratio_c is set
LOG_RATIO_CLAMP = 20.0


def resolve_epsilons(loss_name: str, epsilon_low=None, epsilon_high=None):
    """(eps_low, eps_high): the given values, or the loss's defaults where a value is None."""
    d_low, d_high = DEFAULT_EPSILONS.get(loss_name, DEFAULT_EPSILONS["ppo_clip"])
    return (d_low if epsilon_low is None else epsilon_low), (d_high if epsilon_high is None else epsilon_high)


def resolve_aggregation(loss_name: str, aggregation=None) -> str:
    """The given aggregation, or the loss's own (``DEFAULT_AGGREGATION``; token-mean for a plugin's loss)."""
    return aggregation or DEFAULT_AGGREGATION.get(loss_name, "token-mean")


def aggregation_of(alg) -> str:
    """The aggregation in force for an algorithm config (its field, else its policy loss's default)."""
    return resolve_aggregation(alg.policy_loss, getattr(alg, "aggregation", None))


def _epsilons(cfg, loss_name):
    return resolve_epsilons(loss_name, getattr(cfg, "epsilon_low", None), getattr(cfg, "epsilon_high", None))


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _default_seq_sum(x):
    return x.sum(-1)


def _prepare(logp, old_logp, advantages, mask):
    """Shapes, dtypes and sanitised inputs: everything off the mask is replaced by 0 before any arithmetic, so
    padding may hold anything (NaN, -inf) without reaching the values or the gradients.

    Returns (mask, advantages [B, L] detached, on (bool), logp_on, log_ratio), log_ratio = logp - old_logp on the
    mask and exactly 0 (no gradient) off it.
    """
    mask = mask.to(logp.dtype)
    on = mask > 0
    zero = torch.zeros_like(logp)
    advantages = torch.as_tensor(advantages, dtype=logp.dtype, device=logp.device)
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = torch.where(on, advantages.expand_as(logp).detach(), zero)
    logp_on = torch.where(on, logp, zero)
    log_ratio = logp_on - torch.where(on, old_logp.detach(), zero)
    return mask, advantages, on, logp_on, log_ratio


def _seq_log_ratio(log_ratio, mask, seq_sum):
    """[B, 1]: mean over the row's masked tokens of the log ratio, both sums through seq_sum."""
    return (seq_sum(log_ratio * mask) / seq_sum(mask).clamp_min(1.0)).unsqueeze(-1)


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, clip_c):
    """PPO clipped surrogate (per token, to minimise) with optional dual clip on A < 0. Returns (loss, indicators)."""
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = torch.maximum(pg1, pg2)
    with torch.no_grad():
        ind = {
            "clip_frac": (pg2 > pg1),
            "clip_frac_low": (ratio < 1 - eps_low) & (advantages < 0),
            "clip_frac_high": (ratio > 1 + eps_high) & (advantages > 0),
        }
    if clip_c is not None:
        if clip_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_c}")
        pg3 = -advantages * clip_c
        neg = advantages < 0
        dual = torch.minimum(loss, pg3)
        with torch.no_grad():
            ind["dual_clip_frac"] = neg & (pg3 < loss)
        loss = torch.where(neg, dual, loss)
    return loss, ind


def _finish(policy_term, logp_on, mask, on, cfg, ref_logp, rollout_is_weights, metrics):
    """Multiplies the policy term by the rollout IS weights, adds the (unweighted) KL loss term, applies the mask;
    fills the common metrics."""
    zero = torch.zeros_like(logp_on)
    loss = policy_term
    if rollout_is_weights is not None:  # the policy gradient's sampling correction only (verl)
        loss = loss * torch.where(on, rollout_is_weights.detach().to(loss.dtype), zero)
    kl_coef = getattr(cfg, "kl_coef", 0.0) or 0.0
    if ref_logp is not None and kl_coef != 0.0 and not getattr(cfg, "kl_in_reward", False):
        ref_on = torch.where(on, ref_logp.detach().to(logp_on.dtype), zero)
        kl = torch.where(on, kl_penalty(getattr(cfg, "kl_estimator", "k3"))(logp_on, ref_on), zero)
        loss = loss + kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = torch.where(on, loss, zero) * mask
    return loss, {k: v.detach() for k, v in metrics.items()}


def _ppo_family(name, logp, old_logp, advantages, mask, cfg, ref_logp, rollout_is_weights, seq_sum, level):
    seq_sum = seq_sum or _default_seq_sum
    mask, adv, on, logp_on, log_ratio = _prepare(logp, old_logp, advantages, mask)
    eps_low, eps_high = _epsilons(cfg, name)
    clip_c = getattr(cfg, "clip_ratio_c", None)
    if level == "token":
        log_w = log_ratio
    else:
        seq = _seq_log_ratio(log_ratio, mask, seq_sum)  # [B, 1]
        if level == "sequence":
            log_w = seq.expand_as(logp)
        else:  # sequence_token: value s_i, gradient through each token's logp
            log_w = logp_on - logp_on.detach() + seq.detach()
    ratio = torch.exp(torch.clamp(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    term, ind = _clipped_surrogate(ratio, adv, eps_low, eps_high, clip_c)
    with torch.no_grad():
        metrics = {k: _masked_mean(v.to(mask.dtype), mask) for k, v in ind.items()}
        metrics["approx_kl"] = _masked_mean(0.5 * log_ratio.pow(2), mask)
        metrics["ratio_mean"] = _masked_mean(ratio, mask)
    return _finish(term, logp_on, mask, on, cfg, ref_logp, rollout_is_weights, metrics)


@register_policy_loss("ppo_clip")
def ppo_clip(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None):
    """PPO clipped surrogate max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - old_logp), dual-clipped
    at -A * clip_ratio_c where A < 0."""
    return _ppo_family(
        "ppo_clip", logp, old_logp, advantages, mask, cfg, ref_logp, rollout_is_weights, seq_sum, "token"
    )


@register_policy_loss("gspo")
def gspo(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None):
    """GSPO: the clipped surrogate on the sequence ratio exp(seq_sum(mask * log r) / seq_sum(mask))."""
    return _ppo_family("gspo", logp, old_logp, advantages, mask, cfg, ref_logp, rollout_is_weights, seq_sum, "sequence")


@register_policy_loss("gspo_token")
def gspo_token(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None):
    """GSPO-token: the clipped surrogate on sg[s_i] * pi(y_t) / sg[pi(y_t)] (value s_i, per-token gradient)."""
    return _ppo_family(
        "gspo_token", logp, old_logp, advantages, mask, cfg, ref_logp, rollout_is_weights, seq_sum, "sequence_token"
    )


@register_policy_loss("cispo")
def cispo(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None):
    """CISPO: -sg[min(r, eps_high)] * A * logp, eps_high an absolute cap (> 1; default 5.0)."""
    mask, adv, on, logp_on, log_ratio = _prepare(logp, old_logp, advantages, mask)
    _, cap = _epsilons(cfg, "cispo")
    if cap is None or cap <= 1:
        raise ValueError(f"cispo needs epsilon_high > 1: it is an absolute cap on the ratio (e.g. 5.0), got {cap}")
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    weight = torch.clamp(ratio, max=cap)
    term = -weight * adv * logp_on
    with torch.no_grad():
        capped = ratio > cap  # the weight is capped whatever the advantage's sign
        metrics = {
            "clip_frac": _masked_mean(capped.to(mask.dtype), mask),  # every capped token, as the name says
            # the capped tokens with A > 0 (ms-swift's and our earlier clip_frac: grpo_trainer.py, loss_type cispo)
            "cispo_clip_frac_pos": _masked_mean((capped & (adv > 0)).to(mask.dtype), mask),
            "approx_kl": _masked_mean(0.5 * log_ratio.pow(2), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return _finish(term, logp_on, mask, on, cfg, ref_logp, rollout_is_weights, metrics)


@register_policy_loss("sapo")
def sapo(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None):
    """SAPO: -sigmoid(tau (r - 1)) * 4 / tau * A, tau = tau_pos where A > 0 else tau_neg (both > 0)."""
    mask, adv, on, logp_on, log_ratio = _prepare(logp, old_logp, advantages, mask)
    tau_pos, tau_neg = float(getattr(cfg, "tau_pos", 1.0)), float(getattr(cfg, "tau_neg", 1.05))
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0, got {tau_pos} and {tau_neg}")
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    term = -(gate * 4 / tau) * adv
    with torch.no_grad():
        weight = 4 * gate * (1 - gate)  # df/dr: 1 on-policy
        metrics = {
            "clip_frac": _masked_mean((weight < 0.5).to(mask.dtype), mask),
            "sapo_grad_weight": _masked_mean(weight, mask),
            "approx_kl": _masked_mean(0.5 * log_ratio.pow(2), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return _finish(term, logp_on, mask, on, cfg, ref_logp, rollout_is_weights, metrics)


def policy_loss_names():
    return tuple(DEFAULT_EPSILONS)


__all__ = [
    "DEFAULT_AGGREGATION",
    "DEFAULT_EPSILONS",
    "DUAL_CLIP_VERL",
    "aggregation_of",
    "resolve_aggregation",
    "resolve_epsilons",
    "ppo_clip",
    "gspo",
    "gspo_token",
    "cispo",
    "sapo",
    "policy_loss_names",
]
