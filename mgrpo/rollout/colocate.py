"""One GPU, two tenants: the colocated engine and the trainer take turns with the device memory.

The step's phases (verl's `ActorRolloutRefWorker.update_weights` / `rollout_mode` in
`verl/workers/engine_workers.py` and `verl/workers/megatron_workers.py`, NeMo-RL's `refit_policy_generation` in
`nemo_rl/algorithms/grpo.py`, slime's `train.py`):

    start                        trainer built (and resumed); offload(); then the engine starts: vLLM claims
                                 gpu_memory_utilization x the device only if that much is free
    rollout                      engine awake; trainer's optimizer / grads / params on the host (train.offload)
    to_train()                   engine sleeps (rollout.vllm.sleep_level), trainer's memory comes back
    old/ref logprobs, train
    to_push()                    engine wakes its weights (never its KV cache yet: both would not fit)
    weight push, save            the save reads the optimizer on the device
    to_rollout()                 the trainer's memory goes to the host, then the engine wakes its KV cache
    ... validation, next rollout ...

verl orders it the same way (`update_weights`: resume weights, push, offload the model, resume the KV cache).

Level 1 keeps the engine's weights in host memory; level 2 drops them, which is safe only because every push
sends every weight (vllm#29341: a level-2 wake without a full reload serves garbage), so level 2 is refused
with LoRA adapter-only sync. vLLM's `wake_up(tags)` wakes nothing if any tag named is awake already, so each
tag is woken by its own call (OpenRLHF's `LLMRayActor.wake_up` does the same).
"""

from __future__ import annotations

import time

from mgrpo.actor_offload import Offloader


class ColocatedMemory:
    def __init__(self, cfg, actor):
        self.level = cfg.rollout.vllm.sleep_level if cfg.rollout.engine == "vllm" else 0
        self.engine = None  # attach(): only the ranks that own an engine, and only where it sleeps
        self.offloader = Offloader(cfg.train.offload, actor.chunks, actor.optimizer)
        self.timings: dict = {}
        self.moved: dict = {}

    def attach(self, engine) -> None:
        """The engine, once started (after the first offload)."""
        self.engine = engine if self.level else None

    @property
    def active(self) -> bool:
        return bool(self.level) or self.offloader.level != "none"

    def _timed(self, name: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t
        return out

    def to_train(self) -> None:
        if self.engine is not None:
            self._timed("sleep", self.engine.sleep, self.level)
        self._timed("restore", self.offloader.restore)

    def to_push(self) -> None:
        if self.engine is not None:
            self._timed("wake_weights", self.engine.wake_up, ["weights"])

    def to_rollout(self) -> None:
        self.offload()
        if self.engine is not None:
            self._timed("wake_kv_cache", self.engine.wake_up, ["kv_cache"])

    def offload(self) -> None:
        self.moved = self._timed("offload", self.offloader.offload)

    def metrics(self) -> dict:
        """memory/* of the step: seconds of each turn (inside the phase timers: `sync` holds the weights' wake;
        `timing/other` the sleep, restore, offload and the KV cache's wake) and GB the trainer parked. {} when neither side takes turns."""
        if not self.active:
            return {}
        out = {f"memory/{k}_s": v for k, v in self.timings.items()}
        out.update({f"memory/offloaded_{k}_gb": v / 2**30 for k, v in self.moved.items()})
        self.timings = {}
        return out

    def restore_trainer(self) -> None:
        """The trainer's memory back without touching the engine (the run's end: the HF export reads the weights)."""
        self.offloader.restore()
