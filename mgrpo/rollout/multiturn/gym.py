"""`GymScheduler` and gym-style environments (`Env`: reset, step, close), ms-swift's contract.

One environment per trajectory, made from the row's `env_config` (its `name`, or the scheduler's `gym_env`):
`reset()` gives the first observation (the user message) and an optional system message; after every turn
`step(messages)` gives (observation, reward, done, info); the observation becomes the next user message. The
summed step rewards reach the reward functions as `info["total_reward"]` (reward `env_reward`), with
`step_rewards` and `gym_done`.
"""

from __future__ import annotations

import copy
import random
import re

from mgrpo.rollout.multiturn.base import MultiTurnScheduler
from mgrpo.rollout.multiturn.registry import envs, register_env, register_scheduler


class Env:
    """Base environment. Subclasses implement the three coroutines; `env_config` is the row's `env_config`."""

    def __init__(self, env_config: dict):
        self.env_config = dict(env_config or {})

    async def reset(self, config) -> tuple:
        """(observation, info, system_message or ""); `config` is the trajectory's InferRequest (its data_dict)."""
        raise NotImplementedError

    async def step(self, action: list) -> tuple:
        """`action`: the conversation so far (the last message is the model's). Returns (next_observation, reward,
        done, info)."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


@register_env("guess_number")
class GuessNumberEnv(Env):
    """Guess a hidden integer in [low, high]; the answer is 'higher' or 'lower'. Reward 1 for the right number,
    otherwise 0.1 x closeness (1 - distance / span), so a near miss scores a little."""

    async def reset(self, config) -> tuple:
        row = config.data_dict or {}
        self.low, self.high = int(self.env_config.get("low", 1)), int(self.env_config.get("high", 20))
        target = row.get("target", self.env_config.get("target"))
        self.target = int(target) if target is not None else random.Random(config.uuid).randint(self.low, self.high)
        self.guesses = 0
        text = f"Guess the number between {self.low} and {self.high}. Reply with the number only."
        return text, {"target": self.target}, self.env_config.get("system_message", "")

    async def step(self, action: list) -> tuple:
        found = re.search(r"-?[0-9]+", action[-1]["content"])  # ASCII only: \d also matches other scripts
        self.guesses += 1
        if found is None:
            return "Reply with a number.", 0.0, False, {"guesses": self.guesses}
        guess = int(found.group())
        if guess == self.target:
            return "Correct!", 1.0, True, {"guesses": self.guesses, "solved": True}
        closeness = max(0.0, 1.0 - abs(guess - self.target) / max(self.high - self.low, 1))
        hint = "higher" if guess < self.target else "lower"
        return f"{guess} is wrong; the number is {hint}.", 0.1 * closeness, False, {"guesses": self.guesses}


@register_scheduler("gym", "gym_scheduler")
class GymScheduler(MultiTurnScheduler):
    def __init__(self, *args, gym_env: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gym_env = gym_env
        self._envs, self._rewards, self._pending = {}, {}, {}  # by trajectory uuid

    def _create_env(self, env_config: dict) -> Env:
        name = env_config.get("name", self.gym_env)
        if name not in envs:
            raise KeyError(
                f"environment {name!r} is not registered; known: {', '.join(sorted(envs))} (set a row's "
                f"env_config.name or rollout.scheduler_kwargs.gym_env)"
            )
        return envs[name](env_config)

    async def on_trajectory_start(self, requests: list) -> None:
        for req in requests:
            env = self._create_env(dict((req.data_dict or {}).get("env_config") or {}))
            observation, _info, system = await env.reset(req)
            req.messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": observation}
            ]
            self._envs[req.uuid], self._rewards[req.uuid], self._pending[req.uuid] = env, [], None

    async def on_turn_end(self, infer_request, response_choice, current_turn) -> dict:
        uid = infer_request.uuid
        env = self._envs.get(uid)
        if env is None:
            return {"done": True}
        observation, reward, done, info = await env.step(copy.deepcopy(infer_request.messages))
        self._rewards[uid].append(float(reward))
        self._pending[uid] = None if done else observation
        infos = {
            "total_reward": sum(self._rewards[uid]),
            "step_rewards": list(self._rewards[uid]),
            "gym_done": bool(done),
        }
        infos.update({f"env_{k}": v for k, v in (info or {}).items()})
        return {"done": bool(done), "rollout_infos": infos}

    def step(self, infer_request, response_choice, current_turn) -> dict:
        observation = self._pending.pop(infer_request.uuid, None)
        if observation is not None:
            infer_request.messages.append({"role": "user", "content": observation})
        return {"infer_request": infer_request}

    async def on_trajectory_end(self, requests: list, error=None) -> None:
        for req in requests:
            env = self._envs.pop(req.uuid, None)
            self._rewards.pop(req.uuid, None)
            self._pending.pop(req.uuid, None)
            if env is not None:
                await env.close()
