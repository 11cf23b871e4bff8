"""Outcome rewards by name. Two kinds of function, one registry:

- batched: `fn(samples, tokenizer, **kwargs) -> list[float | None]` (`@register_reward("name")`), sync or async
  (async ones run concurrently, each under `reward.timeout_s`);
- per sample: `fn(completion: str, **kwargs) -> float | None` (`@register_reward("name", per_sample=True)`); with
  `isolated=True` each call runs in a worker process under `reward.timeout_s` (`mgrpo.rewards.pool`): a call that
  hangs is killed, its worker replaced, and only that sample fails. math-verify rewards are isolated.

Arguments by name: `reward.kwargs` go to every function; a parameter named like a dataset column gets that column
(a list for batched functions, the sample's value per sample); per-sample functions may also take `length` (the
sample's model tokens: its loss-mask tokens over every turn), `max_tokens` (the response's token budget,
`response_token_budget`) and `info` (the sample's info dict).

`score()` stores each score in `sample.info['rewards']` and sets the weighted sum per sample. What a value means
(ms-swift's semantics, with failures made explicit):

- a number: counted with its weight;
- `None`: "not applicable to this sample", skipped in the weighted sum (a nansum); a sample where every
  function says None gets 0;
- NaN (or inf), or the function raising or timing out: the sample FAILED. Its reward is NaN, so the advantage
  estimators leave it out and the trainer gives it no loss; a warning names the function and
  `sample.info['reward_failed']` lists it. When a batched call raises, each sample is retried alone so one bad
  sample does not fail the others;
- the wrong number of values (or a value that is not a number): a `RewardError` naming the function.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from mgrpo.registry import Registry, where_defined
from mgrpo.stopping import within

log = logging.getLogger("mgrpo.rewards")
_FAILED = object()


def _note(errors: dict, name: str, exc: BaseException) -> None:
    """Keep a reward's first failure ("ExcType: message") in this score() call's `errors`."""
    errors.setdefault(name, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class RewardError(ValueError):
    """A reward function broke its contract (wrong count or type of values); the message names it."""


class AllRewardsFailed(RuntimeError):
    """Every sample of a call failed its reward (each function's first exception in the message): the run stops."""


@dataclass
class RewardSpec:
    fn: Callable
    per_sample: bool = False  # fn(completion, **kwargs) per sample, instead of fn(samples, tokenizer, **kwargs)
    isolated: bool = False  # per-sample calls run in worker processes under a timeout

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))


REWARDS = Registry("reward", builtins=("mgrpo.rewards.registry", "mgrpo.rewards.outcome"))


def register_reward(name: str, per_sample: bool = False, isolated: bool = False, override: bool = False):
    """`@register_reward("name")` on fn(samples, tokenizer, **kwargs); `per_sample=True` on fn(completion,
    **kwargs); `isolated=True` (per sample only) runs it in the reward worker processes, under a timeout. A name
    already registered (a built-in, another plugin's) is refused unless `override=True`."""
    if isolated and not per_sample:
        raise ValueError(f"reward {name!r}: isolated=True needs per_sample=True (one call per sample)")

    def deco(fn):
        REWARDS.add(name, RewardSpec(fn, per_sample, isolated), override, where=where_defined(fn))
        return fn

    return deco


def reward_names() -> list:
    return REWARDS.names()


def get_spec(name: str) -> RewardSpec:
    return REWARDS.lookup(name)


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


def completion_text(sample, tokenizer) -> str:
    """The model's answer as text: the last assistant message of a multi-turn conversation, else the decoded
    response (special tokens skipped)."""
    if sample.messages and sample.messages[-1].get("role") == "assistant":
        return sample.messages[-1]["content"]
    return tokenizer.decode(sample.response_ids, skip_special_tokens=True) if tokenizer is not None else ""


def _accepts(fn) -> set:
    """Parameter names fn takes by keyword ('**' when it takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {"**"}
    return {"**" if p.kind is p.VAR_KEYWORD else p.name for p in params}


def _column_kwargs(fn, samples: list, kwargs: dict, skip=("samples", "tokenizer", "completion")) -> dict:
    """Dataset columns (from Sample.info) for the parameters fn names explicitly, as lists."""
    names = _accepts(fn) - set(kwargs) - set(skip) - {"**"}
    return {n: [s.info.get(n) for s in samples] for n in names if any(n in s.info for s in samples)}


def _sample_kwargs(accepts: set, sample, kwargs: dict, max_tokens: int | None) -> dict:
    extra = {"length": sum(sample.loss_mask), "max_tokens": max_tokens, "info": sample.info}
    out = {k: v for k, v in kwargs.items() if k in accepts or "**" in accepts}
    out.update({k: v for k, v in extra.items() if k in accepts and k not in kwargs})
    out.update({n: sample.info[n] for n in accepts - set(out) - {"**", "completion"} if n in sample.info})
    return out


def _values(name: str, fn: Callable, samples: list, tokenizer, kwargs: dict, errors: dict) -> list:
    """A batched sync fn's value per sample; _FAILED where it raised (a raising batch is retried one by one)."""
    try:
        return _checked(name, fn(samples, tokenizer, **kwargs, **_column_kwargs(fn, samples, kwargs)), len(samples))
    except RewardError:
        raise
    except Exception as exc:
        _note(errors, name, exc)
        log.warning(
            "reward %r raised %s: %s; scoring its %d samples one by one", name, type(exc).__name__, exc, len(samples)
        )
    out = []
    for s in samples:
        try:
            out += _checked(name, fn([s], tokenizer, **kwargs, **_column_kwargs(fn, [s], kwargs)), 1)
        except RewardError:
            raise
        except Exception as exc:
            _note(errors, name, exc)
            out.append(_FAILED)
    return out


def _per_sample_values(name: str, spec: RewardSpec, samples: list, tokenizer, kwargs: dict, opts, errors: dict) -> list:
    accepts = _accepts(spec.fn)  # once per function, not per sample
    items = [((completion_text(s, tokenizer),), _sample_kwargs(accepts, s, kwargs, opts.max_tokens)) for s in samples]
    if spec.isolated:
        from mgrpo.rewards.pool import FAILED, shared_pool

        pool = shared_pool(opts.workers, opts.plugins)
        raw = pool.map(spec.fn, [(a, {k: v for k, v in kw.items() if k != "info"}) for a, kw in items], opts.timeout_s)
        raw = [_FAILED if v is FAILED else v for v in raw]
        if any(v is _FAILED for v in raw):
            errors.setdefault(
                name, f"raised or ran past reward.timeout_s={opts.timeout_s:g} s in a reward worker process"
            )
    else:
        raw = []
        for args, kw in items:
            try:
                raw.append(spec.fn(*args, **kw))
            except Exception as exc:  # noqa: BLE001  (this sample failed)
                _note(errors, name, exc)
                raw.append(_FAILED)
    ok = [v for v in raw if v is not _FAILED]
    _checked(name, ok, len(ok))  # types
    return [v if v is _FAILED or v is None else float(v) for v in raw]


async def _async_values(specs: dict, samples: list, tokenizer, kwargs: dict, timeout_s: float, errors: dict) -> dict:
    async def one(name, fn):
        try:
            got = await within(fn(samples, tokenizer, **kwargs, **_column_kwargs(fn, samples, kwargs)), timeout_s)
            return _checked(name, got, len(samples))
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001  (a raise or a timeout fails the batch's samples)
            _note(errors, name, exc)
            log.warning(
                "async reward %r failed for its %d samples: %s",
                name,
                len(samples),
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
            )
            return [_FAILED] * len(samples)

    names = list(specs)
    results = await asyncio.gather(*(one(n, specs[n].fn) for n in names))
    return dict(zip(names, results))


def _checked(name: str, values, n: int) -> list:
    values = list(values) if values is not None else []
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} samples; it must return "
            f"one value (a number, or None for 'not applicable') per sample"
        )
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
            raise RewardError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}); return a number, or "
                f"None for 'not applicable'"
            )
    return [None if v is None else float(v) for v in values]


@dataclass
class ScoreOptions:
    timeout_s: float = 10.0  # per isolated call, per async function
    workers: int = 2  # reward worker processes (isolated rewards)
    plugins: tuple = ()  # plugin files the workers import (their rewards register there too)
    max_tokens: int | None = None  # the response's token budget (response_token_budget), for length-shaped rewards


def response_token_budget(rollout) -> int | None:
    """The most model tokens one sample's response can hold, what length-shaped rewards (`soft_overlong`'s L_max,
    `cosine`'s max length) measure `length` (the loss-mask tokens of the whole trajectory) against: rollout.max_tokens
    for a single turn, max_turns x max_tokens for a multi-turn scheduler with max_turns, else None (unbounded:
    such a reward then needs its own limit in reward.kwargs)."""
    if rollout.scheduler in (None, "single_turn"):
        return rollout.max_tokens
    return rollout.max_turns * rollout.max_tokens if rollout.max_turns else None


def score(samples, tokenizer, funcs: list, weights=None, kwargs=None, options: ScoreOptions | None = None) -> list:
    """Weighted nansum of the reward functions per sample (NaN for a failed sample); sets `sample.reward`."""
    opts, kwargs = options or ScoreOptions(), dict(kwargs or {})
    weights = list(weights) if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(funcs)} reward.funcs")
    specs = {name: get_spec(name) for name in funcs}
    errors: dict = {}  # each function's first failure in this call (a local: the producer thread scores too)
    asyncs = {n: sp for n, sp in specs.items() if sp.is_async and not sp.per_sample}
    table = asyncio.run(_async_values(asyncs, samples, tokenizer, kwargs, opts.timeout_s, errors)) if asyncs else {}
    for name, spec in specs.items():
        if name in table:
            continue
        table[name] = (
            _per_sample_values(name, spec, samples, tokenizer, kwargs, opts, errors)
            if spec.per_sample
            else _values(name, spec.fn, samples, tokenizer, kwargs, errors)
        )
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
        first = "; ".join(f"reward {n!r}: {errors.get(n, 'returned NaN or inf')}" for n in names)
        if n_failed == len(samples):
            raise AllRewardsFailed(
                f"every one of the {len(samples)} samples failed its reward, so nothing can "
                f"train; first failure: {first}. Fix the reward function (or its inputs) and "
                f"run again"
            )
        log.warning(
            "%d of %d samples failed their reward (%s): they get no advantage and no loss",
            n_failed,
            len(samples),
            first,
        )
    return total
