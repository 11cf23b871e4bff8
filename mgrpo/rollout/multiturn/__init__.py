"""Rollout schedulers (ms-swift's contract): single-turn, multi-turn, tool calls, tips, gym environments."""

from mgrpo.rollout.multiturn import builtin  # noqa: E402,F401  (registers the built-ins in multi_turns / envs)
from mgrpo.rollout.multiturn.base import MultiTurnScheduler, RolloutScheduler, SchedulerError
from mgrpo.rollout.multiturn.gym import Env, GymScheduler  # noqa: E402
from mgrpo.rollout.multiturn.math_tips import MathTipsScheduler  # noqa: E402
from mgrpo.rollout.multiturn.registry import envs, multi_turns, register_env, register_scheduler
from mgrpo.rollout.multiturn.tool_call import ToolCallScheduler  # noqa: E402
from mgrpo.rollout.multiturn.types import ChatMessage, InferRequest, ResponseChoice, RolloutOutput

__all__ = [
    "RolloutScheduler",
    "MultiTurnScheduler",
    "SchedulerError",
    "InferRequest",
    "ResponseChoice",
    "RolloutOutput",
    "ChatMessage",
    "register_scheduler",
    "register_env",
    "multi_turns",
    "envs",
    "Env",
    "GymScheduler",
    "MathTipsScheduler",
    "ToolCallScheduler",
]
