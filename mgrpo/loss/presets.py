"""ms-swift ``loss_type`` names as presets: (policy loss, aggregation, scale_rewards, epsilon overrides).

Source: ms-swift's GRPO trainer (modelscope/ms-swift, swift/trainers/rlhf_trainer/grpo_trainer.py,
``_compute_loss_and_metrics``):

==========  ==========  ===========================  =============  ==============  ==============================
Presets fill only what the user left unset (YAML or flag): ``loss_type: dapo`` with ``epsilon_high: 0.35`` keeps
0.35. The start-up log says where every resolved value came from (``mgrpo.config.describe_algorithm``).

preset      policy      aggregation                  scale_rewards  eps low/high    ms-swift lines
==========  ==========  ===========================  =============  ==============  ==============================
grpo        ppo_clip    seq-mean-token-mean          group          cfg             L1240-1242
bnpo        ppo_clip    token-mean                   group          cfg             L1243-1244
dr_grpo     ppo_clip    seq-mean-token-sum-norm      none           cfg             L1245-1247
dapo        ppo_clip    token-mean                   group          0.2 / 0.28      L1209, L1281-1284
cispo       cispo       token-mean                   group          - / 5.0         L1192-1194, L1281
sapo        sapo        seq-mean-token-mean          group          - (tau 1/1.05)  L1192-1204, L1240
==========  ==========  ===========================  =============  ==============  ==============================

``scale_rewards='group'`` is ms-swift's default for the grpo estimator. Not from that trainer: Dr. GRPO's
``none`` (the Dr. GRPO paper drops the std division; ms-swift leaves it to ``--scale_rewards none``), DAPO's
clip-higher 0.2 / 0.28 (DAPO paper; the trainer only says clip-higher) and CISPO's cap 5.0 (ms-swift's CISPO
page, after ScaleRL). "cfg" means the preset leaves ``cfg.epsilon_low/high`` alone (None there = the policy loss's
default, see ``mgrpo.loss.policy.DEFAULT_EPSILONS``).

Where we differ on purpose: ms-swift normalises ``grpo`` (mean over the micro-batch's sequences), ``bnpo`` (the
micro-batch's token count) and ``dr_grpo`` (micro-batch size x max_completion_length) per micro-batch and process.
We aggregate over the global batch (all DP ranks, CP ranks and micro-batches of the optimizer step) with per-token
weights from global counts, so the loss does not depend on how the batch is split. ``dapo``/``cispo`` already divide
by the global token count in ms-swift (``num_items_in_batch``), so for them nothing changes; and ``bnpo`` and
``dapo`` aggregate identically here (they differ only in the epsilons).

Aggregation names (defined on one whole batch by ``aggregate_reference``; the distributed version must match it):

- ``token-mean``: ``sum_{i,t} m l / sum_{i,t} m``.
- ``seq-mean-token-mean``: ``mean_i (sum_t m l / max(1, sum_t m))``; every sequence counts in the mean, also one with
  an empty mask (it contributes 0), as in ms-swift's ``.mean()`` over rows.
- ``seq-mean-token-sum`` (verl's name): ``mean_i sum_t m l``; every sequence counts, long ones weigh more.
- ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum_{i,t} m l / (N * max_len)`` with the constant ``max_len`` =
  the maximum completion length (``rollout.max_tokens``), not the longest sequence of the batch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Preset:
    policy_loss: str
    aggregation: str
    scale_rewards: str
    epsilon_low: Optional[float] = None  # None: keep cfg's value
    epsilon_high: Optional[float] = None


PRESETS: dict[str, Preset] = {
    "grpo": Preset(policy_loss="ppo_clip", aggregation="seq-mean-token-mean", scale_rewards="group"),
    "bnpo": Preset(policy_loss="ppo_clip", aggregation="token-mean", scale_rewards="group"),
    "dr_grpo": Preset(policy_loss="ppo_clip", aggregation="seq-mean-token-sum-norm", scale_rewards="none"),
    "dapo": Preset(
        policy_loss="ppo_clip", aggregation="token-mean", scale_rewards="group", epsilon_low=0.2, epsilon_high=0.28
    ),
    "cispo": Preset(policy_loss="cispo", aggregation="token-mean", scale_rewards="group", epsilon_high=5.0),
    "sapo": Preset(policy_loss="sapo", aggregation="seq-mean-token-mean", scale_rewards="group"),
}


def resolve_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise KeyError(f"loss preset {name!r} is unknown; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_values(name: str, user_set=frozenset()) -> dict:
    """The fields preset ``name`` fills, leaving out every field in ``user_set`` (set in YAML or by a flag).

    The preset's epsilons and aggregation belong to its policy loss: when the user picked another policy loss,
    they are not filled (that loss's own defaults apply), so ``--algorithm.loss_type dapo --algorithm.policy_loss
    gspo`` never runs GSPO with DAPO's 0.2 / 0.28 or its token-mean (GSPO's own is seq-mean-token-mean).
    """
    p = resolve_preset(name)
    values = {"policy_loss": p.policy_loss, "scale_rewards": p.scale_rewards}
    if "policy_loss" not in user_set:
        values["aggregation"] = p.aggregation
        if p.epsilon_low is not None:
            values["epsilon_low"] = p.epsilon_low
        if p.epsilon_high is not None:
            values["epsilon_high"] = p.epsilon_high
    return {k: v for k, v in values.items() if k not in user_set}


def apply_preset(cfg, name: str, user_set=frozenset()):
    """A copy of ``cfg`` (dataclass or namespace) with the preset's fields set, except those in ``user_set``."""
    values = preset_values(name, user_set)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.replace(cfg, **values)
    out = copy.copy(cfg)
    for k, v in values.items():
        setattr(out, k, v)
    return out


def aggregate_reference(
    per_token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, max_len: Optional[int] = None
) -> torch.Tensor:
    """The definition of each aggregation on one whole (global) batch ``[N, L]``; for tests and single-process use."""
    mask = mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask
    if aggregation == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1)
    if aggregation == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
    if aggregation == "seq-mean-token-sum":
        return masked.sum(-1).mean()
    if aggregation == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the maximum completion length)")
        return masked.sum() / (per_token_loss.shape[0] * max_len)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
