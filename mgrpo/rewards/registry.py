"""Outcome rewards: a registry of plain functions `fn(samples, tokenizer, **kwargs) -> list[float]`.

`score()` runs the configured functions, stores each score in `sample.info['rewards']` and returns the
weighted sum per sample. Plugins register more with `@register_reward("name")`.
"""
from __future__ import annotations

import math
from typing import Callable

_REWARDS: dict[str, Callable] = {}


def register_reward(name: str):
    def deco(fn):
        _REWARDS[name] = fn
        return fn
    return deco


def get_reward(name: str) -> Callable:
    if name not in _REWARDS:
        raise KeyError(f"reward {name!r} is not registered; known: {', '.join(sorted(_REWARDS))}")
    return _REWARDS[name]


def _target_ids(tokenizer, target_chars: str) -> set:
    cache = getattr(tokenizer, "_mgrpo_target_ids", {})
    if target_chars not in cache:
        ids = set()
        for tid in range(len(tokenizer)):
            text = tokenizer.decode([tid])
            if text.strip() and all(c in target_chars for c in text.strip()):
                ids.add(tid)
        cache[target_chars] = ids
        tokenizer._mgrpo_target_ids = cache
    return cache[target_chars]


@register_reward("token_fraction")
def token_fraction(samples, tokenizer, target_chars: str = "0123456789", **_):
    """Fraction of completion tokens whose text is made only of `target_chars` (a learnable toy task:
    a random model already earns a small, varying reward, unlike arithmetic where it earns 0)."""
    target = _target_ids(tokenizer, target_chars)
    out = []
    for s in samples:
        toks = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
        out.append(sum(t in target for t in toks) / len(toks) if toks else 0.0)
    return out


@register_reward("response_length")
def response_length(samples, tokenizer, max_tokens: int = 32, **_):
    """Length of the response over max_tokens, in [0, 1]."""
    return [min(1.0, len(s.response_ids) / max_tokens) for s in samples]


def score(samples, tokenizer, funcs: list, weights=None, kwargs=None) -> list:
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(funcs)} reward.funcs")
    total = [0.0] * len(samples)
    for name, w in zip(funcs, weights):
        values = get_reward(name)(samples, tokenizer, **(kwargs or {}))
        for i, (s, v) in enumerate(zip(samples, values)):
            s.info.setdefault("rewards", {})[name] = v
            total[i] += w * v if v is not None and not math.isnan(v) else float("nan")
    for s, r in zip(samples, total):
        s.reward = r
    return total
