"""The GRPO loop, top to bottom: rollout -> reward (-> dynamic sampling) -> advantages -> old logprobs -> train ->
weight sync (-> validation). With rollout.mode one_step_off / async the producer generates the next batches while
a step trains (mgrpo/rollout/producer.py).

Engines live on global rank 0 or on the first rank of each DP replica (`rollout.engine_placement`); their
samples reach every rank as JSON bytes, and each replica exports its weights to its own engine.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from tqdm import tqdm

from mgrpo.actor import Actor, reference_policy
from mgrpo.checkpoint import Saver, load_training_state, pause_point
from mgrpo.data.batching import build_generation_batch, describe_batching, generation_batch_kl
from mgrpo.data.dataset import PromptStream, load_run_data
from mgrpo.data.dynamic_sampling import collect, unit_groups
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.loss.advantages import compute_advantages
from mgrpo.loss.kl import penalize_rewards
from mgrpo.metrics import step_clock, step_metrics
from mgrpo.parallel.distributed import init_distributed
from mgrpo.parallel.state import setup_model_parallel
from mgrpo.parallel.watchdog import start_watchdog
from mgrpo.profiling import StepTimer
from mgrpo.resume import check_resume
from mgrpo.rollout.colocate import ColocatedMemory
from mgrpo.rollout.manager import (
    RolloutError,
    RolloutManager,
    adapter_sync,
    engine_owners,
    make_weight_sync,
    needs_initial_weights,
    owner_index,
    push_weights,
    start_engine,
)
from mgrpo.rollout.producer import RolloutProducer
from mgrpo.run_logger import RunLogger
from mgrpo.validation import Validator


class GRPOTrainer:
    def __init__(self, cfg, data: tuple | None = None):
        """`data`: (training, held-out) PromptSets already loaded by the launcher, or None to load them here."""
        self.cfg = cfg
        init_distributed(hang_dir=os.path.join(cfg.logging.output_dir, "hang"))
        setup_model_parallel(cfg.parallel, cfg.train.seed)
        self.rank = dist.get_rank()
        self.watchdog = start_watchdog(cfg.logging.output_dir, cfg.train.step_timeout_s)  # no silent hangs
        self.dp = dist.get_world_size() // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        self.tokenizer = load_tokenizer(cfg.model.path)
        train_set, val_set = data or load_run_data(cfg, self.tokenizer)
        self.prompts = PromptStream(train_set.rows, cfg.rollout.prompts_per_step, cfg.data.shuffle, cfg.train.seed)
        self.actor = Actor(cfg, cfg.model.path)
        self.ref = reference_policy(cfg, self.actor)  # None without KL; LoRA: the base, adapters off
        self.saver, self.version = Saver(cfg), 0
        resumed = self.load_checkpoint()  # before any engine: the trainer's whole state fits the device alone
        self.memory = ColocatedMemory(cfg, self.actor)  # engine sleep and trainer offload, in turns
        self.memory.offload()  # vLLM starts only where gpu_memory_utilization x the device is free (train.offload)
        self.owners = engine_owners(cfg.rollout.engine_placement)  # {dp rank: global rank} of each engine
        self.engine = start_engine(cfg, self.tokenizer, self.owners)  # None on ranks that own no engine
        self.memory.attach(self.engine)
        self.weight_sync = make_weight_sync(cfg, self.engine)  # every rank: its WeightSync (NoEngine: no engine)
        self.rollout = RolloutManager(cfg, self.tokenizer, self.owners, self.engine, owner_index(self.owners) or 0)
        self.validator = val_set and Validator(cfg, val_set, self.rollout, self.tokenizer, write=self.rank == 0)
        self.producer = RolloutProducer(cfg, self.rollout, self.prompts, cfg.train.steps)
        self.start_step = self.restore(resumed)
        self.log = RunLogger(cfg, enabled=self.rank == 0, resume_step=self.start_step)  # cut back on resume
        self.update_metrics = []  # per optimizer step of the last rollout step (mini-batches x iterations)
        if self.rank == 0:
            print(
                "\n".join(
                    ["data: " + train_set.summary()]
                    + (["eval: " + val_set.summary()] if val_set else [])
                    + [describe_batching(cfg, self.dp)]
                ),
                flush=True,
            )

    def load_checkpoint(self) -> dict | None:
        """A resumed run's state from its checkpoint (models, optimizer, LR schedule, RNG, data position, weight
        version); None on a fresh start."""
        if not self.cfg.checkpoint.resume:
            return None
        notes = check_resume(self.cfg)  # the launcher checked already; a trainer built in-process checks here
        if not self.cfg.checkpoint.resume:  # --resume auto before any save
            if self.rank == 0:
                print("\n".join(notes), flush=True)
            return None
        common = load_training_state(self.actor, self.cfg.checkpoint.resume, self.cfg)
        self.actor.load_train_state(common["actor"])
        self.prompts.load_state_dict(common["prompts"])
        self.version = common["weight_version"]
        if self.rank == 0:
            print("\n".join(notes), flush=True)
        return common

    def restore(self, common: dict | None) -> int:
        """The rollouts a resumed run had in flight, then the trainer's weights into engines that may hold others
        (any, on resume; remote servers, always) under the current version. Returns the first step to run."""
        start = common["step"] if common else 0
        if common:
            self.producer.restore(common.get("rollouts_in_flight"), start)  # generated by weights now gone
        if common or needs_initial_weights(self.cfg):
            self.version -= 1
            self.memory.to_train()  # a colocated engine sleeps and the trainer's memory comes back for the push
            self.memory.to_push()
            self.sync_weights()
            self.memory.to_rollout()
        return start

    def rollout_and_score(self, step: int, round_: int = 0) -> list:
        """A fresh batch of prompts, generated and scored by the engines; every rank gets every sample."""
        return self.rollout.rollout(self.prompts.next_batch(), step, round_)  # every rank draws: streams stay in step

    def collect(self, step: int) -> tuple:
        """The step's training samples and their metrics: one round, or DAPO dynamic sampling's several."""
        a = self.cfg.algorithm
        if not a.dynamic_sampling:
            return self.producer.batch(step, self.version)
        draw = lambda round_: self.rollout_and_score(step, round_)  # noqa: E731
        samples, counts = collect(
            draw,
            self.cfg.rollout.prompts_per_step,
            unit_groups(self.cfg, self.dp),
            a.max_resample_times,
            warn=self.rank == 0,
            overlong_filter=a.overlong_filter,
        )
        return samples, {**counts.metrics(), **self.rollout.fault_metrics()}

    def sync_weights(self) -> dict:
        """Every DP replica that has an engine exports to it (views, one copy into the engine); returns the sync/
        metrics (bytes this rank's engine got; LoRA adapter-only sync: the adapters alone)."""
        self.version += 1
        return push_weights(
            self.weight_sync,
            self.actor.current_params(),
            self.version,
            self.owners,
            self.cfg.rollout.update_bucket_mb << 20,
            adapter_only=adapter_sync(self.cfg),
        )

    def step(self, step: int) -> dict:
        """One step, its checkpoint included (verl's `step` timer holds its save too); `timing/step` is its wall
        clock and `timing/other` what no phase timer saw."""
        timer, alg = StepTimer(["rollout", "old_logprob", "ref_logprob", "train", "sync"]), self.cfg.algorithm
        with timer("rollout"):
            pause_point("rollout", step)  # test hook: Ctrl-C mid-rollout
            samples, extra = self.collect(step)
        self.memory.to_train()  # the engine sleeps, the trainer's memory comes back
        batch = build_generation_batch(samples, self.cfg, self.tokenizer.pad_token_id, warn=self.rank == 0, step=step)
        for key, actor in (("old_logp", self.actor if batch.needs_old_logprobs else None), ("ref_logp", self.ref)):
            if actor is not None:
                with timer(key.replace("_logp", "_logprob")):
                    batch.set_logprobs(key, actor)
        rewards = batch.trained_rewards()  # samples that train nothing leave the group statistics (DAPO)
        if self.ref is not None and alg.kl_in_reward:
            seq_kl = generation_batch_kl(batch)
            rewards = penalize_rewards(rewards, seq_kl, alg.kl_coef)
            extra["actor/kl_ref"] = float(seq_kl[batch.valid].mean()) if batch.valid.any() else 0.0
        adv = compute_advantages(alg.advantage, rewards, batch.group_ids, alg, lengths=batch.lengths)
        batch.set_advantages(adv)
        with timer("train"):
            updates = [self.actor.train_step(mbs) for mbs in batch.updates(self.cfg.train.num_iterations)]
        pause_point("train", step)  # test hook: a kill between the update and the sync
        with timer("sync"):
            self.memory.to_push()  # the engine's weights wake; its KV cache waits until the trainer's memory is out
            extra.update(self.sync_weights())
        with timer("save"):
            self.maybe_save(step + 1)  # before the offload: the save reads the optimizer on the device
        self.memory.to_rollout()  # the trainer's memory to the host (train.offload), then the engine's KV cache
        self.log.log_completions(step, samples, adv.tolist(), self.tokenizer, batch.sample_entropies())
        extra["data/epoch"] = self.prompts.epoch
        metrics, self.update_metrics = step_metrics(self.cfg, samples, updates, extra, self.version)
        if self.validator and self.validator.due(step + 1):  # after the sync: the current weights
            with timer("val"):
                metrics.update(self.validator.run(step, self.version))
        metrics.update(self.memory.metrics())
        return step_clock(metrics, timer, samples)

    def maybe_save(self, done_steps: int) -> None:
        """The whole training state every checkpoint.save_interval steps and at the end (mgrpo/checkpoint.py)."""
        self.saver.poll()
        if self.saver.due(done_steps):
            self.saver.save(
                self.actor,
                done_steps,
                {
                    "step": done_steps,
                    "weight_version": self.version,
                    "prompts": self.prompts.state_dict(),
                    "actor": self.actor.train_state(),
                    "rollouts_in_flight": self.producer.settle(),
                },
            )

    def fit(self) -> list:
        log, history = self.log, []
        try:
            if self.validator and self.cfg.eval.before_train and not self.start_step:  # on the initial weights
                log.log_before_training(self.validator.run(-1, self.version))
            for step in range(self.start_step, self.cfg.train.steps):
                with self.watchdog.step(step):
                    metrics = self.step(step)
                history.append(metrics)
                log.log(step, metrics)
            self.memory.restore_trainer()  # the HF export reads the weights
            self.saver.close()  # an async save finishes before the run ends
            self.saver.export_hf(self.actor, self.cfg.train.steps)
        except RolloutError as exc:  # said before the engines close: torchrun may end this rank meanwhile
            if self.rank == 0:
                tqdm.write(f"error: {exc}", file=sys.stderr)  # on a line of its own, above the progress bar
            exc.reported = True
            raise
        except RuntimeError:  # a collective broke: name a peer whose process is gone (parallel/watchdog.py)
            line = self.watchdog.gone_peers()
            if line:
                tqdm.write(f"error: rank {self.rank}: {line}", file=sys.stderr)
            raise
        finally:
            log.close()
            self.close()
        return history

    def close(self) -> None:
        """An async save in flight is finished; engines (and their processes and buffers) end with the run."""
        for part in (self.watchdog, self.saver, self.producer, self.weight_sync, self.engine):
            if hasattr(part, "close"):
                part.close()
