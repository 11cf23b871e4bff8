"""An mgrpo plugin: one file that registers a reward, an ms-swift-style reward class, a multi-turn scheduler, a
gym environment and a policy loss by name. Load it with

    python launch/train_grpo.py --config examples/tiny_cpu_gym.yaml --external-plugins examples/plugin.py \\
        --reward.funcs '[short_answer, swift_digits, env_reward]' --rollout.scheduler countdown_gym \\
        --algorithm.policy_loss ppo_clip_halved

Plugins load only from the paths given; every name below becomes usable in the config.
"""

import os

from mgrpo.loss.registry import policy_loss, register_policy_loss
from mgrpo.rewards import orms, register_reward
from mgrpo.schedulers import Env, GymScheduler, register_env, register_scheduler


# 1. A reward, per sample: fn(completion, **columns and reward.kwargs) -> float | None
@register_reward("short_answer", per_sample=True)
def short_answer(completion: str, short_answer_chars: int = 16, **_):
    """1.0 for answers of at most `short_answer_chars` characters, falling off linearly to 0 at twice that."""
    return max(0.0, min(1.0, 2.0 - len(completion.strip()) / short_answer_chars))


# 2. An ms-swift ORM, registered through ms-swift's own idiom (mgrpo's `orms` adapts it)
class SwiftDigits:
    """Fraction of digit characters in each completion (ms-swift ORM: completions in, one float each out)."""

    def __call__(self, completions, **kwargs):
        return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


orms["swift_digits"] = SwiftDigits


# 3. A gym environment: count down from the row's `start`; the model should answer start-1, start-2, ...
@register_env("countdown")
class CountdownEnv(Env):
    async def reset(self, config):
        self.next = int((config.data_dict or {}).get("target", 10))
        return f"Count down from {self.next}. Say {self.next}.", {}, ""

    async def step(self, action):
        said = action[-1]["content"].strip()
        ok = said.startswith(str(self.next))
        self.next -= 1
        return f"Now say {self.next}.", float(ok), self.next <= 0, {"correct": ok}


# 4. A scheduler: a GymScheduler that always plays the countdown game
@register_scheduler("countdown_gym")
class CountdownGym(GymScheduler):
    def _create_env(self, env_config):
        return CountdownEnv(env_config)


# 5. A policy loss: PPO-clip at half strength (same signature as every built-in loss)
@register_policy_loss("ppo_clip_halved")
def ppo_clip_halved(logp, old_logp, advantages, mask, cfg, **kwargs):
    loss, metrics = policy_loss("ppo_clip")(logp, old_logp, advantages, mask, cfg, **kwargs)
    return 0.5 * loss, metrics


# 6. Optional: a reward model from an HF folder (AutoModelForSequenceClassification, one label)
if os.environ.get("MGRPO_REWARD_MODEL"):
    from mgrpo.rewards import SequenceClassifierReward

    register_reward("reward_model")(SequenceClassifierReward(os.environ["MGRPO_REWARD_MODEL"], batch_size=16))
