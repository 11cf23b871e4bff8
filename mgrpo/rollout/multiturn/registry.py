"""Schedulers and environments by name: `rollout.scheduler: tool_call` and a row's `env_config.name` (or the
scheduler's `gym_env`). ms-swift's names work too (`multi_turns` / `envs` are the same dicts)."""

from __future__ import annotations

from typing import Callable

from mgrpo.registry import Registry

# ms-swift's registry names: `multi_turns["name"] = cls` and `envs["name"] = cls` work as there
multi_turns = Registry(
    "scheduler",
    builtins=(
        "mgrpo.rollout.multiturn.base",
        "mgrpo.rollout.multiturn.builtin",
        "mgrpo.rollout.multiturn.gym",
        "mgrpo.rollout.multiturn.tool_call",
        "mgrpo.rollout.multiturn.math_tips",
    ),
)
envs = Registry("environment", builtins=("mgrpo.rollout.multiturn.builtin", "mgrpo.rollout.multiturn.gym"))


def register_scheduler(*names: str, override: bool = False) -> Callable:
    """@register_scheduler("name", "alias") on a scheduler class."""
    return multi_turns.register(*names, override=override)


def register_env(*names: str, override: bool = False) -> Callable:
    """@register_env("name") on an Env class."""
    return envs.register(*names, override=override)


def scheduler_names() -> list:
    return multi_turns.names()


def make_rollout_scheduler(cfg, tokenizer, max_total_tokens: int | None):
    """The configured scheduler; `rollout.scheduler_kwargs` go to its constructor (e.g. gym_env, tips_prompt)."""
    r = cfg.rollout
    kwargs = dict(r.scheduler_kwargs or {})
    return multi_turns.lookup(r.scheduler, "rollout.scheduler")(
        None, r.max_turns, tokenizer=tokenizer, max_total_tokens=max_total_tokens, **kwargs
    )
