"""Outcome rewards: the registry, built-ins, ms-swift ORM adapter, reward models."""

from mgrpo.rewards.adapters import orms, register_orm
from mgrpo.rewards.registry import ScoreOptions, completion_text, register_reward, reward_names, score
from mgrpo.rewards.reward_model import SequenceClassifierReward

__all__ = [
    "register_reward",
    "reward_names",
    "score",
    "ScoreOptions",
    "completion_text",
    "orms",
    "register_orm",
    "SequenceClassifierReward",
]
