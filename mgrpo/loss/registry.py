"""Registries of pure functions, one signature per kind (verl style).

- policy losses: fn(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None)
  -> (per_token_loss, metrics); aggregation over tokens is separate (see aggregation.py); `seq_sum` sums a
  [B, L] tensor per sequence, across CP ranks when the sequence is split.
- advantages: fn(rewards [N], group_ids [N], cfg) -> [N]
"""

from __future__ import annotations

from typing import Callable

from mgrpo.registry import Registry

POLICY_LOSSES = Registry("policy loss", builtins=("mgrpo.loss.policy",))
ADVANTAGES = Registry("advantage estimator", builtins=("mgrpo.loss.advantages",))


def register_policy_loss(name: str, override: bool = False):
    return POLICY_LOSSES.register(name, override=override)


def register_advantage(name: str, override: bool = False):
    return ADVANTAGES.register(name, override=override)


def policy_loss(name: str) -> Callable:
    return POLICY_LOSSES.lookup(name, "algorithm.policy_loss")


def advantages(name: str) -> Callable:
    return ADVANTAGES.lookup(name, "algorithm.advantage")
