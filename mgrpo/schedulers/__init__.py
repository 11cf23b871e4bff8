"""Rollout schedulers (ms-swift's contract): single-turn, multi-turn, tool calls, tips, gym environments."""

from mgrpo.schedulers import builtin  # noqa: E402,F401  (registers the built-ins in multi_turns / envs)
from mgrpo.schedulers.base import MultiTurnScheduler, RolloutScheduler, SchedulerError
from mgrpo.schedulers.gym import Env, GymScheduler  # noqa: E402
from mgrpo.schedulers.math_tips import MathTipsScheduler  # noqa: E402
from mgrpo.schedulers.registry import envs, multi_turns, register_env, register_scheduler
from mgrpo.schedulers.tool_call import ToolCallScheduler  # noqa: E402
from mgrpo.schedulers.types import ChatMessage, InferRequest, ResponseChoice, RolloutOutput

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
