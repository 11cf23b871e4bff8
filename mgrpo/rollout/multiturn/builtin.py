"""Registers the built-in schedulers and environments (imported by the registry on first use)."""

from mgrpo.rollout.multiturn import gym, math_tips, tool_call  # noqa: F401
from mgrpo.rollout.multiturn.base import RolloutScheduler
from mgrpo.rollout.multiturn.registry import register_scheduler

register_scheduler("single_turn")(RolloutScheduler)
