"""KL penalties between the policy and the reference model, per token: ``kl_penalty(name)(logp, ref_logp) -> [B, L]``.

Notation: ``logp = log pi_theta(y_t)``, ``ref_logp = log pi_ref(y_t)`` at the sampled tokens, ``d = logp - ref_logp``
and ``r = pi_ref / pi_theta = exp(-d)``. The target is the reverse KL ``KL(pi_theta || pi_ref) = E_{pi_theta}[d]``.
"Gradient" below means what autograd gives when the per-token value is used as a loss term on samples drawn from
``pi_theta`` (on-policy), in expectation over those samples. With PPO-style reuse the samples come from ``pi_old``,
so all of these statements hold only approximately (to the extent ``pi_old ~= pi_theta``).

- ``k1 = d``. Unbiased estimate of the KL *value*. As a loss its gradient is ``grad log pi_theta``, whose
  expectation is 0: it contributes nothing in expectation. That is why k1 is used as a reward penalty instead
  (``kl_in_reward``): subtracting ``beta * sum_t d_t`` from the reward makes the policy-gradient estimator multiply it
  by ``grad log pi_theta``, which is the score-function gradient of the reverse KL.
- ``k2 = 0.5 * d**2``. Biased estimate of the value (it matches the KL to second order near ``pi_ref``), but its
  gradient ``d * grad log pi_theta`` has expectation ``E[(log pi_theta - log pi_ref) grad log pi_theta]``
  ``= grad KL(pi_theta || pi_ref)`` exactly: as a loss, k2 gives an unbiased gradient of the reverse KL.
- ``k3 = r - 1 - log r = exp(-d) + d - 1`` (Schulman's estimator; ms-swift's and the GRPO paper's KL loss).
  Unbiased and non-negative estimate of the KL *value* (``E[r] = 1``), lower variance than k1. But as a loss its
  gradient is ``(1 - r) grad log pi_theta``, whose expectation is ``-E_{pi_ref}[grad log pi_theta]``
  ``= grad KL(pi_ref || pi_theta)``: the gradient of the *forward* KL, not of the reverse KL it estimates. The two
  agree to first order near ``pi_ref`` but are not the same objective.

Clamps (ms-swift ``_compute_loss_and_metrics`` L1130-1133, seed lines 1075-1077 and 1644-1647): the log ratio is
clamped to ``[-20, 20]`` before ``exp`` and k3 is clamped to ``[-10, 10]``; we apply the same log-ratio clamp to k2
(ms-swift has no k2) and none to k1. Where a clamp is active the token's gradient is 0.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from mgrpo.registry import Registry

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

KL_ESTIMATORS = Registry(
    "KL estimator", builtins=("mgrpo.loss.kl",), aliases={"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
)


def register_kl(name: str, override: bool = False):
    return KL_ESTIMATORS.register(name, override=override)


def kl_penalty(name: str) -> Callable:
    """``fn(logp, ref_logp) -> per_token [B, L]`` (not masked). Names: k1, k2, k3 (aliases kl, mse, low_var_kl)."""
    return KL_ESTIMATORS.lookup(name)


def kl_estimator_names() -> list:
    """Every name `kl_penalty` accepts, aliases included."""
    return KL_ESTIMATORS.names()


@register_kl("k1")
def k1(logp, ref_logp):
    """logp - ref_logp: unbiased value, zero expected gradient as a loss (use it in the reward)."""
    return logp - ref_logp


@register_kl("k2")
def k2(logp, ref_logp):
    """0.5 * clamp(logp - ref_logp, -20, 20)**2: biased value, unbiased reverse-KL gradient as a loss."""
    d = torch.clamp(logp - ref_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return 0.5 * d * d


@register_kl("k3")
def k3(logp, ref_logp):
    """clamp(exp(x) - x - 1, -10, 10), x = clamp(ref_logp - logp, -20, 20) (ms-swift): unbiased value, forward-KL
    gradient as a loss."""
    x = torch.clamp(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1, -K3_CLAMP, K3_CLAMP)


def kl_in_reward(logp, ref_logp, mask):
    """Per-token k1 = (logp - ref_logp) * mask, detached: the reward penalty of ``kl_in_reward`` mode.

    How it is used (ms-swift ``_compute_advantages`` L483-497): with ``logp`` the rollout-time (old) policy logprobs,
    each sample's KL is the sum of this over its completion tokens (``sequence_kl``), and before the advantages are
    computed the reward becomes ``r_i - kl_coef * KL_i``. The KL loss term is then off (``kl_in_reward=True`` and
    ``kl_coef != 0`` means no ``kl_coef * k`` in the per-token loss). Padding may hold anything: it is zeroed.
    """
    m = mask > 0
    d = torch.where(m, logp.detach() - ref_logp.detach(), torch.zeros_like(logp, dtype=logp.dtype))
    return d * mask


def sequence_kl(logp, ref_logp, mask, seq_sum: Optional[Callable] = None):
    """[B]: per-sequence sum of k1 over the mask, through ``seq_sum`` (a CP all-reduce when the row is split)."""
    seq_sum = seq_sum or (lambda x: x.sum(-1))
    return seq_sum(kl_in_reward(logp, ref_logp, mask))


def penalize_rewards(rewards, seq_kl, kl_coef: float):
    """rewards - kl_coef * seq_kl (NaN rewards stay NaN, so they stay invalid for the advantage estimators)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    return rewards - kl_coef * torch.as_tensor(seq_kl, dtype=torch.float64).to(rewards.device)
