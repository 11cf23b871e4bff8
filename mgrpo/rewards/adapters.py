"""ms-swift reward classes in mgrpo: an ORM is a class whose `__call__(completions, **kwargs)` returns one value
per completion, with dataset columns as keyword lists (`solution=[...]`). `register_orm("name", MyORM)` or
ms-swift's own idiom, `orms["name"] = MyORM`, registers it as a batched mgrpo reward; async ORMs stay async."""

from __future__ import annotations

import inspect

from mgrpo.rewards.registry import completion_text, register_reward

# Sample.info keys mgrpo itself writes; everything else there is a dataset column or a scheduler's rollout_infos
INTERNAL = {"engine", "rewards", "reward_failed", "num_turns", "env_tokens", "logprobs_dropped", "trajectory_error"}


def _columns(samples) -> dict:
    names = {k for s in samples for k in s.info if k not in INTERNAL}
    return {n: [s.info.get(n) for s in samples] for n in sorted(names)}


def register_orm(name: str, orm):
    """Register an ms-swift ORM class (instantiated with no arguments) or instance under `name`."""
    instance = orm() if isinstance(orm, type) else orm
    call = instance.__call__

    if inspect.iscoroutinefunction(call):

        async def reward(samples, tokenizer, **kwargs):
            completions = [completion_text(s, tokenizer) for s in samples]
            messages = [s.messages for s in samples]
            return list(await instance(completions, messages=messages, **{**_columns(samples), **kwargs}))
    else:

        def reward(samples, tokenizer, **kwargs):
            completions = [completion_text(s, tokenizer) for s in samples]
            messages = [s.messages for s in samples]
            return list(instance(completions, messages=messages, **{**_columns(samples), **kwargs}))

    reward.__name__ = f"orm_{name}"  # the ORM's class names it: two ORMs under one name are a duplicate
    reward.__module__, reward.__qualname__ = type(instance).__module__, type(instance).__qualname__
    register_reward(name)(reward)
    return orm


class _OrmRegistry(dict):
    """`orms["name"] = MyORM` registers it (ms-swift's plugin idiom)."""

    def __setitem__(self, name, orm):
        register_orm(name, orm)
        super().__setitem__(name, orm)


orms = _OrmRegistry()
