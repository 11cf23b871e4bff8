"""Rollout batches for the trainer, generated ahead while it trains (`rollout.mode`).

sync: step s's batch is generated at step s, with the weights of the step before it. one_step_off (ms-swift's
async_generate, verl's one-step-off trainer) and async keep the batches of the next `max_staleness` steps in
flight: at step s the producer generates steps s+1..s+k on the engine owners' background thread while the trainer
trains on step s. Prompts are drawn in step order on every rank, as in sync, so step s trains the same prompts
with the same sampling seeds in every mode; only the weights that generated them differ.

A weight push between optimizer steps waits for the engine's call in flight (vLLM's server gate, the colocated
engine's, the HF engine's and the SGLang guard's drain pause new generation for an update and let the running call
finish), so each batch comes from one weight version and no response mixes versions. With `rollout.partial`
(vLLM engines, colocated or remote) a push holds the requests in flight instead and continues them on the new
weights (verl's partial rollout, AReaL's interruptible generation): a response may span versions, and each token
carries the version that sampled it and that version's logprob (`Sample.token_versions`, `rollout_logprobs`).
Staleness = the version being trained - the oldest version in a sample; groups over `max_staleness` are
dropped and counted (with this producer they never are unless a run is resumed with a smaller bound).
`max_staleness: 0` in async mode runs the same machinery with nothing ahead: bitwise the sync run. A checkpoint
stores the batches in flight (`settle`); with partial rollout it interrupts their responses instead of waiting for
them, and this run, or the one resumed from it, continues each from its prefix (`_continue_interrupted`).

Off-policy correction (on by default whenever batches may be stale, max_staleness >= 1; config.py): the PPO ratio's old policy is the trainer's own
policy before this step's update (AReaL's proximal policy), and the engine's logprobs are the behaviour policy of
a truncated importance weight on every token (TIS, `algorithm.rollout_is_mode: token_truncate`):
    L = -sum_t min(pi_old_t / pi_engine_t, C) * min(r_t A, clip(r_t, 1 - eps, 1 + eps) A),  r_t = pi_t / pi_old_t
(AReaL's decoupled PPO, areal/utils/functional/functional.py `ppo_actor_loss_fn`; verl's rollout correction,
verl/trainer/ppo/rollout_corr_helper.py). With one update per batch pi_old is the current policy detached.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from mgrpo.rollout.types import Sample


def staleness_bound(rollout_cfg) -> int:
    """Batches generated ahead: 0 in sync mode, 1 one_step_off, max_staleness (default 2) async."""
    if rollout_cfg.mode not in ("one_step_off", "async"):
        return 0
    if rollout_cfg.mode == "one_step_off":
        return 1
    return 2 if rollout_cfg.max_staleness is None else rollout_cfg.max_staleness


def token_staleness(samples: list, version: int) -> dict:
    """Per-token staleness (partial rollout: a response's tokens may come from several versions) and how many
    responses span more than one version."""
    stale = [version - v for s in samples for v in (s.token_versions or [s.weight_version] * len(s.response_ids))]
    return {
        "async/token_staleness_mean": sum(stale) / max(len(stale), 1),
        "async/token_staleness_max": max(stale, default=0),
        "rollout/partial_samples": sum(len(set(s.token_versions or ())) > 1 for s in samples),
    }


def oldest_version(sample: Sample) -> int:
    """The version of a sample's oldest token (its `weight_version`, unless its tokens say otherwise)."""
    return min(sample.token_versions) if sample.token_versions else sample.weight_version


def fresh_groups(samples: list, version: int, bound: int) -> tuple:
    """Samples whose group is within the staleness bound (by each sample's oldest token: a partial response is as
    stale as its first token), how many were dropped, and the kept ones' staleness."""
    too_old = {s.group_id for s in samples if version - oldest_version(s) > bound}
    kept = [s for s in samples if s.group_id not in too_old]
    return kept, len(samples) - len(kept), [version - oldest_version(s) for s in kept]


class _Shared(list):
    """A batch already on every rank (shared at a checkpoint, or restored from one)."""


class RolloutProducer:
    """Batches by step, generated up to `k` steps ahead on owners; `batch(step, version)` on every rank."""

    def __init__(self, cfg, manager, prompts, total_steps: int):
        self.cfg, self.manager, self.prompts, self.total = cfg, manager, prompts, total_steps
        self.k = staleness_bound(cfg.rollout)
        self.threaded = cfg.rollout.mode != "sync"
        # partial: the batches in flight generate at once (the next batch's requests fill the slots a long tail
        # leaves; a push no longer waits for them); otherwise one after the other. A scheduler's batches go one
        # at a time: its one instance (it may hold state across trajectories) holds one batch's turn client.
        workers = max(1, self.k) if cfg.rollout.partial and not cfg.rollout.scheduler else 1
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rollout") if self.threaded else None
        self.lock, self.running = threading.Lock(), 0  # batches generating now (owners)
        self.pending = {}  # step -> rows (sync), Future of the owner's payload, None (no engine here), or _Shared
        self.next_draw = None  # the first step whose prompts are not drawn yet
        self.idle_since, self.idle = time.perf_counter(), 0.0  # the engine waiting for the trainer (owners)
        self.generate_s: dict = {}  # step -> seconds its batch took to generate and score (owners)

    def _generate(self, rows: list, step: int, work=None) -> dict:
        """One batch on this owner's engine (`work`: another job for it, e.g. continuing interrupted responses);
        time with no batch generating is engine idle time (a batch queued behind another starts when it ends: no
        gap)."""
        start = time.perf_counter()
        with self.lock:
            if self.running == 0:
                self.idle += start - self.idle_since
            self.running += 1
        try:
            return work() if work is not None else self.manager.generate_local(rows, step)
        finally:
            end = time.perf_counter()
            with self.lock:
                self.running -= 1
                if self.running == 0:
                    self.idle_since = end
            self.generate_s[step] = self.generate_s.get(step, 0.0) + end - start  # the producer's time on it

    def _draw_through(self, last: int) -> None:
        """Draw prompts (every rank, in step order) and start generation (owners, threaded modes) up to `last`."""
        while self.next_draw <= last:
            step, rows = self.next_draw, self.prompts.next_batch()
            if not self.threaded:
                self.pending[step] = rows  # generated in the main thread when its step asks for it
            else:
                self.pending[step] = self.pool.submit(self._generate, rows, step) if self.manager.engine else None
            self.next_draw += 1

    def batch(self, step: int, version: int) -> tuple:
        """(samples of `step` every rank trains on, async/ and timing/wait_* metrics: in the ahead modes only)."""
        if self.next_draw is None:
            self.next_draw = step
        self._continue_interrupted()  # before the next draw: the engine takes them first
        self._draw_through(max(step, min(step + self.k, self.total - 1)))  # nothing ahead past the run's last step
        t0 = time.perf_counter()
        entry = self.pending.pop(step)
        if isinstance(entry, _Shared):
            samples = list(entry)
        elif not self.threaded:
            samples = self.manager.share(self._generate(entry, step) if self.manager.engine else {"samples": []})
        else:
            samples = self.manager.share(entry.result() if entry is not None else {"samples": []})
        waited = time.perf_counter() - t0
        samples, dropped, stale = self._fresh(samples, version)
        metrics = {
            "timing/wait_rollout": waited,
            "timing/wait_train": self.idle,
            "timing/generate": self.generate_s.pop(step, 0.0),
            "async/discarded": dropped,
            "async/staleness_mean": sum(stale) / max(len(stale), 1),
            "async/staleness_max": max(stale, default=0),
            **token_staleness(samples, version),
            "async/continued_samples": sum("continued_from" in s.info for s in samples),
            # interrupted trajectories whose scheduler asked a recorded turn with another context (generated afresh)
            "async/replay_mismatch": sum(s.info.get("replay_mismatch", 0) for s in samples),
        }
        self.idle = 0.0
        return samples, {**(metrics if self.threaded else {}), **self.manager.fault_metrics()}

    def _fresh(self, samples: list, version: int) -> tuple:
        return fresh_groups(samples, version, self.k)

    def interrupts(self) -> bool:
        """Whether a checkpoint interrupts the responses in flight instead of waiting for them: partial rollout
        (its responses may span versions anyway) on an engine that can (vLLM, colocated or remote). A scheduler's
        trajectories stop at their turn in flight and are replayed turn by turn when continued
        (`multiturn.driver.continue_scheduled`)."""
        r = self.cfg.rollout
        return bool(r.partial and hasattr(self.manager.engine, "interrupt"))

    def settle(self) -> list:
        """Every batch in flight, shared (a collective): [[step, [sample dicts]]] for a checkpoint, so a resumed
        run trains exactly these batches (they came from weights it will no longer have). With partial rollout
        the responses still generating are interrupted (their tokens so far kept: "interrupted") instead of
        waited for; this run, or one resumed from the checkpoint, continues each from its prefix
        (`_continue_interrupted`)."""
        from dataclasses import asdict

        interrupting = self.threaded and self.interrupts() and any(isinstance(e, Future) for e in self.pending.values())
        if interrupting:
            self.manager.settling = True  # a scheduler's trajectories start no new turn
            try:
                self.manager.engine.interrupt()
            except Exception as exc:  # noqa: BLE001  (the batches then finish as they are: the save waits for them)
                print(f"mgrpo: warning: engine {self.manager.engine.name} was not interrupted for the save: {exc}")
        try:
            for step in sorted(self.pending):
                entry = self.pending[step]
                if self.threaded and not isinstance(entry, _Shared):
                    self.pending[step] = _Shared(
                        self.manager.share(entry.result() if entry is not None else {"samples": []})
                    )
        finally:
            self.manager.settling = False
        if interrupting:
            held = [s for v in self.pending.values() if isinstance(v, _Shared) for s in v]
            cut = sum(s.finish_reason == "interrupted" for s in held)
            print(f"mgrpo: checkpoint: {cut} of {len(held)} responses in flight interrupted (continued after it)")
        return [[step, [asdict(s) for s in v]] for step, v in sorted(self.pending.items()) if isinstance(v, _Shared)]

    def _continue_interrupted(self) -> None:
        """Batches a checkpoint interrupted (in this run or the one it resumes) go back to the engines: their
        interrupted responses continue from their prefixes on the weights of now, like a partial push would have
        continued them (every rank decides alike: each holds the same shared batch)."""
        for step, entry in sorted(self.pending.items()):
            if isinstance(entry, _Shared) and any(s.finish_reason == "interrupted" for s in entry):
                samples = list(entry)
                if self.pool is None:
                    self.pending[step] = _Shared(self.manager.share(self.manager.continue_local(samples, step)))
                elif self.manager.engine is None:
                    self.pending[step] = None
                else:
                    work = partial(self.manager.continue_local, samples, step)
                    self.pending[step] = self.pool.submit(self._generate, None, step, work)

    def restore(self, saved: list, next_step: int) -> None:
        """The batches a checkpoint stored as in flight, ready for their steps (their prompts were drawn already)."""
        for step, samples in saved or []:
            self.pending[int(step)] = _Shared(Sample(**d) for d in samples)
        self.next_draw = max([next_step] + [int(step) + 1 for step, _ in saved or []])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
