"""Registers the built-in schedulers and environments (imported by the registry on first use)."""

from mgrpo.schedulers import gym, math_tips, tool_call  # noqa: F401
from mgrpo.schedulers.base import RolloutScheduler
from mgrpo.schedulers.registry import register_scheduler

register_scheduler("single_turn")(RolloutScheduler)
