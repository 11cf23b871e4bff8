"""Rollout importance-sampling correction for the engine/trainer gap (ms-swift ``rollout_importance_sampling_mode``).

The engine (vLLM, ...) samples with ``rollout_logp``; the trainer's own forward pass at rollout time gives
``old_logp`` for the same tokens. They differ numerically (kernels, precision) or because the engine lags behind
(async). The per-token ratio ``rho_t = pi_old / pi_rollout = exp(old_logp - rollout_logp)`` reweights the loss so
that it is an expectation under ``pi_old``; ``rollout_is_weights`` returns the weights, which the policy loss
multiplies into its policy-gradient term only (verl's order; the KL term to the reference is not reweighted, see
``mgrpo.loss.policy``). The weights carry no gradient.

Modes (``mode``; threshold ``C`` default 2.0, ``rollout_importance_sampling_threshold`` in ms-swift):

- ``token_truncate`` (TIS, alias ``tis``): ``w_t = min(rho_t, C)``.
- ``token_mask`` (MIS, alias ``mis``): ``w_t = rho_t`` if ``lower <= rho_t <= C`` else 0.
- ``seq_geomean_truncate`` / ``seq_geomean_mask``: the sequence ratio is the GEOMETRIC MEAN of the token ratios,
  ``rho_seq = exp(seq_sum(mask * log rho) / seq_sum(mask))`` (ms-swift's ``sequence_truncate`` / ``sequence_mask``,
  ``_compute_sequence_level_ratios``; GSPO-style length normalisation). Length-normalised and therefore biased: it
  is not the likelihood ratio of the sequence. These are what the ms-swift names ``sequence_truncate``,
  ``sequence_mask`` (and our aliases ``seq_tis``, ``seq_mis``) mean.
- ``seq_product_truncate`` / ``seq_product_mask``: the sequence ratio is the PRODUCT of the token ratios,
  ``rho_seq = exp(clamp(seq_sum(mask * log rho), -20, 20))``: the unbiased sequence likelihood ratio (verl's
  ``rollout_is: sequence``). High variance on long sequences.
- ``*_truncate``: ``w_t = min(rho_seq, C)`` for every token of the sequence; ``*_mask``: ``w_t = rho_t`` if
  ``lower <= rho_seq <= C`` else 0 (whole sequence dropped; kept sequences keep their token-level ratios, as
  ms-swift does).

Both sums go through ``seq_sum`` so a row split over context parallel ranks gives the same ratio on every rank.
``lower`` defaults to None (no lower bound, as ms-swift); token log ratios are clamped to ``[-20, 20]`` before
``exp`` (ms-swift's safety bound). Weights are 0 off the mask.

Samples without rollout logprobs (an engine or scheduler that returned none; ``Sample.rollout_logprobs = None``)
are EXCLUDED from the correction, never treated as logprob 0: ``has_rollout`` (0/1 per token) marks the tokens
that have one; the others get weight 1 (the plain loss), are left out of every metric here, and the trainer counts
them (``rollout_is/missing_logprob_samples``) and warns.

Metrics (masked means over this micro-batch's tokens that have rollout logprobs, detached):
``rollout_logp_abs_diff`` = mean |old - rollout|;
``rollout_kl_k1`` = mean(rollout - old) and ``rollout_kl_k3`` = mean(rho - 1 - log rho); with samples drawn from the
engine both estimate ``KL(pi_rollout || pi_old)`` (k3 is the low-variance, non-negative one);
``rollout_is_weight_mean``; and ``rollout_is_clip_frac`` (truncate modes: tokens whose weight was capped) or
``rollout_is_mask_frac`` (mask modes: tokens whose weight was zeroed).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

MODES = (
    "token_truncate",
    "token_mask",
    "seq_geomean_truncate",
    "seq_geomean_mask",
    "seq_product_truncate",
    "seq_product_mask",
)
ALIASES = {
    "tis": "token_truncate",
    "mis": "token_mask",
    "sequence_truncate": "seq_geomean_truncate",
    "sequence_mask": "seq_geomean_mask",  # ms-swift's names
    "seq_tis": "seq_geomean_truncate",
    "seq_mis": "seq_geomean_mask",
}
LOG_RATIO_CLAMP = 20.0
DEFAULT_THRESHOLD = 2.0


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _default_seq_sum(x):
    return x.sum(-1)


def _log_ratio(old_logp, rollout_logp, mask):
    m = mask > 0
    lr = torch.where(m, old_logp.detach() - rollout_logp.detach(), torch.zeros_like(old_logp))
    return torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _mask(mask, has_rollout, dtype):
    mask = mask.to(dtype)
    return mask if has_rollout is None else mask * has_rollout.to(dtype)


def rollout_offpolicy_metrics(old_logp, rollout_logp, mask, has_rollout=None) -> dict:
    """Diagnostics of the engine/trainer mismatch (no weights): abs logprob difference, k1 and k3 KL."""
    with torch.no_grad():
        mask = _mask(mask, has_rollout, old_logp.dtype)
        lr = _log_ratio(old_logp, rollout_logp, mask)
        return {
            "rollout_logp_abs_diff": _masked_mean(lr.abs(), mask),
            "rollout_kl_k1": _masked_mean(-lr, mask),
            "rollout_kl_k3": _masked_mean(torch.exp(lr) - 1 - lr, mask),
        }


def rollout_is_weights(
    old_logp,
    rollout_logp,
    mask,
    mode: str,
    threshold: float = DEFAULT_THRESHOLD,
    lower: Optional[float] = None,
    seq_sum: Optional[Callable] = None,
    has_rollout=None,
):
    """``(weights [B, L] detached, metrics)`` for one micro-batch; see the module docstring for the modes."""
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"rollout IS mode must be one of {MODES} (or {tuple(ALIASES)}), got {mode!r}")
    if lower is not None and lower >= threshold:
        raise ValueError(f"rollout IS lower bound {lower} must be below the threshold {threshold}")
    seq_sum = seq_sum or _default_seq_sum
    full = mask.to(old_logp.dtype)
    mask = _mask(mask, has_rollout, old_logp.dtype)  # tokens that have a rollout logprob
    with torch.no_grad():
        lr = _log_ratio(old_logp, rollout_logp, mask)
        rho = torch.exp(lr)
        if mode.startswith("seq_"):
            total = seq_sum(lr * mask)
            if mode.startswith("seq_geomean"):
                seq_lr = total / seq_sum(mask).clamp_min(1.0)
            else:
                seq_lr = torch.clamp(total, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            basis = torch.exp(seq_lr).unsqueeze(-1).expand_as(rho)
        else:
            basis = rho
        if mode.endswith("truncate"):
            weights = torch.clamp(basis, max=threshold)
            changed = basis > threshold
        else:
            keep = basis <= threshold
            if lower is not None:
                keep = keep & (basis >= lower)
            weights = torch.where(keep, rho, torch.zeros_like(rho))
            changed = ~keep
        weights = torch.where(mask > 0, weights, torch.ones_like(weights)) * full  # no rollout logprob: weight 1
        metrics = rollout_offpolicy_metrics(old_logp, rollout_logp, mask)
        metrics["rollout_is_weight_mean"] = _masked_mean(weights, mask)
        key = "rollout_is_clip_frac" if mode.endswith("truncate") else "rollout_is_mask_frac"
        metrics[key] = _masked_mean(changed.to(mask.dtype), mask)
    return weights, metrics


def rollout_is_weights_from_cfg(
    old_logp, rollout_logp, mask, cfg, seq_sum: Optional[Callable] = None, has_rollout=None
):
    """Reads ``cfg.rollout_is_mode`` (None: no correction, weights None, metrics still computed when rollout logprobs
    are given), ``cfg.rollout_is_threshold`` (2.0) and ``cfg.rollout_is_lower`` (None)."""
    if rollout_logp is None:
        return None, {}
    mode = getattr(cfg, "rollout_is_mode", None)
    if mode is None:
        return None, rollout_offpolicy_metrics(old_logp, rollout_logp, mask, has_rollout)
    return rollout_is_weights(
        old_logp,
        rollout_logp,
        mask,
        mode,
        threshold=getattr(cfg, "rollout_is_threshold", DEFAULT_THRESHOLD),
        lower=getattr(cfg, "rollout_is_lower", None),
        seq_sum=seq_sum,
        has_rollout=has_rollout,
    )
