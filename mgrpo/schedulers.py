"""ms-swift's contract under mgrpo's first name for it: `from mgrpo.schedulers import MultiTurnScheduler,
multi_turns, Env, envs, register_scheduler, ...` keeps working for plugins. The code is mgrpo/rollout/multiturn/."""

from mgrpo.rollout import multiturn
from mgrpo.rollout.multiturn import *  # noqa: F401,F403

__all__ = list(multiturn.__all__)
