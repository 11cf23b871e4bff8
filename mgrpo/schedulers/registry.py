"""Schedulers and environments by name: `rollout.scheduler: tool_call` and a row's `env_config.name` (or the
scheduler's `gym_env`). ms-swift's names work too (`multi_turns` / `envs` are the same dicts)."""
from __future__ import annotations

from typing import Callable

multi_turns: dict = {}  # name -> scheduler class (ms-swift's registry name)
envs: dict = {}  # name -> Env class


def _registrar(table: dict) -> Callable:
    def register(*names: str) -> Callable:
        def deco(cls):
            for name in names:
                table[name] = cls
            return cls
        return deco
    return register


register_scheduler = _registrar(multi_turns)  # @register_scheduler("name", "alias") on a scheduler class
register_env = _registrar(envs)  # @register_env("name") on an Env class


def _builtins() -> None:
    import mgrpo.schedulers.builtin  # noqa: F401  (registers single_turn, tool_call, math_tips, gym)


def scheduler_names() -> list:
    _builtins()
    return sorted(multi_turns)


def env_names() -> list:
    _builtins()
    return sorted(envs)


def make_scheduler(cfg, tokenizer, max_total_tokens: int | None):
    """The configured scheduler; `rollout.scheduler_kwargs` go to its constructor (e.g. gym_env, tips_prompt)."""
    _builtins()
    r = cfg.rollout
    if r.scheduler not in multi_turns:
        raise KeyError(f"rollout.scheduler={r.scheduler!r} is not registered; known: {', '.join(scheduler_names())}")
    kwargs = dict(r.scheduler_kwargs or {})
    return multi_turns[r.scheduler](None, r.max_turns, tokenizer=tokenizer, max_total_tokens=max_total_tokens,
                                    **kwargs)
