"""Outcome rewards: a registry of plain functions `fn(samples, tokenizer, **kwargs) -> list[float | None]`.

`score()` runs the configured functions, stores each score in `sample.info['rewards']` and sets the weighted
sum per sample. What a function's value means (ms-swift's semantics, with failures made explicit):

- a number: counted with its weight;
- `None`: "not applicable to this sample", skipped in the weighted sum (a nansum); a sample where every
  function says None gets 0;
- NaN (or inf), or the function raising: the sample FAILED. Its reward is NaN, so the advantage estimators leave it out
  and the trainer gives it no loss; a warning names the function and `sample.info['reward_failed']` lists it.
  When a batched call raises, each sample is retried alone so one bad sample does not fail the others;
- the wrong number of values (or a value that is not a number): a `RewardError` naming the function.

Plugins register more with `@register_reward("name")`.
"""
from __future__ import annotations

import logging
import math
import numbers
from typing import Callable

log = logging.getLogger("mgrpo.rewards")
_FAILED = object()


class RewardError(ValueError):
    """A reward function broke its contract (wrong count or type of values); the message names it."""

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


@register_reward("env_reward")
def env_reward(samples, tokenizer, **_):
    """The environment's summed step rewards (GymScheduler's `info["total_reward"]`); None where there is none."""
    return [s.info.get("total_reward") for s in samples]


def _values(name: str, fn: Callable, samples: list, tokenizer, kwargs: dict) -> list:
    """fn's value per sample; _FAILED where it raised (a raising batch is retried one sample at a time)."""
    try:
        return _checked(name, fn(samples, tokenizer, **kwargs), len(samples))
    except RewardError:
        raise
    except Exception as exc:
        log.warning("reward %r raised %s: %s; scoring its %d samples one by one", name, type(exc).__name__, exc,
                    len(samples))
    out = []
    for s in samples:
        try:
            out += _checked(name, fn([s], tokenizer, **kwargs), 1)
        except RewardError:
            raise
        except Exception:
            out.append(_FAILED)
    return out


def _checked(name: str, values, n: int) -> list:
    values = list(values) if values is not None else []
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} samples; it must return "
                          f"one value (a number, or None for 'not applicable') per sample")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
            raise RewardError(f"reward function {name!r} returned {v!r} ({type(v).__name__}); return a number, or "
                              f"None for 'not applicable'")
    return [None if v is None else float(v) for v in values]


def score(samples, tokenizer, funcs: list, weights=None, kwargs=None) -> list:
    """Weighted nansum of the reward functions per sample (NaN for a failed sample); sets `sample.reward`."""
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(funcs)} reward.funcs")
    table = {name: _values(name, get_reward(name), samples, tokenizer, kwargs or {}) for name in funcs}
    total = []
    for i, s in enumerate(samples):
        value, failed = 0.0, []
        scores = s.info.setdefault("rewards", {})
        for name, w in zip(funcs, weights):
            v = table[name][i]
            if v is _FAILED or (v is not None and not math.isfinite(v)):
                failed.append(name)
                scores[name] = None
            else:
                scores[name] = v
                value += w * v if v is not None else 0.0
        if failed:
            s.info["reward_failed"] = failed
        s.reward = float("nan") if failed else value
        total.append(s.reward)
    n_failed = sum(1 for s in samples if s.info.get("reward_failed"))
    if n_failed:
        names = sorted({n for s in samples for n in s.info.get("reward_failed", [])})
        log.warning("%d of %d samples failed their reward (%s): they get no advantage and no loss", n_failed,
                    len(samples), ", ".join(names))
    return total
