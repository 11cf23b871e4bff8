"""Registries of pure functions, one signature per kind (verl style).

- policy losses: fn(logp, old_logp, advantages, mask, cfg, ref_logp=None, rollout_is_weights=None, seq_sum=None)
  -> (per_token_loss, metrics); aggregation over tokens is separate (see aggregation.py); `seq_sum` sums a
  [B, L] tensor per sequence, across CP ranks when the sequence is split.
- advantages: fn(rewards [N], group_ids [N], cfg) -> [N]
"""
from __future__ import annotations

from typing import Callable

_POLICY: dict[str, Callable] = {}
_ADVANTAGE: dict[str, Callable] = {}


def _register(table, kind):
    def outer(name: str):
        def deco(fn):
            table[name] = fn
            return fn
        return deco
    return outer


register_policy_loss = _register(_POLICY, "policy loss")
register_advantage = _register(_ADVANTAGE, "advantage")


def _load_builtins() -> None:
    import importlib

    for module in ("mgrpo.loss.advantages", "mgrpo.loss.policy"):  # built-ins register on import
        importlib.import_module(module)


def _get(table, kind, name):
    _load_builtins()
    if name not in table:
        raise KeyError(f"{kind} {name!r} is not registered; known: {', '.join(sorted(table))}")
    return table[name]


def policy_loss(name: str) -> Callable:
    return _get(_POLICY, "policy loss", name)


def advantages(name: str) -> Callable:
    return _get(_ADVANTAGE, "advantage", name)


def registered(kind: str) -> list:
    """The names registered as `kind` ("policy_loss" or "advantage"), built-ins included."""
    _load_builtins()
    return sorted({"policy_loss": _POLICY, "advantage": _ADVANTAGE}[kind])
