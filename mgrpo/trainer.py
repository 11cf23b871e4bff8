"""The GRPO loop, top to bottom: rollout -> reward (-> dynamic sampling) -> advantages -> old logprobs -> train ->
weight sync (-> validation).

Engines live on global rank 0 or on the first rank of each DP replica (`rollout.engine_placement`); their
samples reach every rank as JSON bytes, and each replica exports its weights to its own engine.
"""
from __future__ import annotations

import torch.distributed as dist

from mgrpo.actor import Actor
from mgrpo.checkpoint import Saver, load_training_state, pause_point
from mgrpo.data.batching import build_generation_batch, describe_batching, sequence_kl
from mgrpo.data.dataset import PromptStream, load_run_data
from mgrpo.data.dynamic_sampling import collect, unit_groups
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.logging import RunLogger
from mgrpo.loss.advantages import compute_advantages
from mgrpo.loss.kl import penalize_rewards
from mgrpo.metrics import step_metrics
from mgrpo.parallel.distributed import init_distributed
from mgrpo.parallel.state import setup_model_parallel
from mgrpo.profiling import StepTimer
from mgrpo.resume import check_resume
from mgrpo.rollout.manager import (RolloutManager, engine_owners, make_transport, needs_initial_weights, owner_index,
                                  push_weights, start_engine)
from mgrpo.validation import Validator


class GRPOTrainer:
    def __init__(self, cfg, data: tuple | None = None):
        """`data`: (training, held-out) PromptSets already loaded by the launcher, or None to load them here."""
        self.cfg = cfg
        init_distributed()
        setup_model_parallel(cfg.parallel, cfg.train.seed)
        self.rank = dist.get_rank()
        self.dp = dist.get_world_size() // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        self.tokenizer = load_tokenizer(cfg.model.path)
        train_set, val_set = data or load_run_data(cfg, self.tokenizer)
        self.prompts = PromptStream(train_set.rows, cfg.rollout.prompts_per_step, cfg.data.shuffle, cfg.train.seed)
        self.actor = Actor(cfg, cfg.model.path)
        self.ref = Actor(cfg, cfg.model.path, train=False) if cfg.algorithm.kl_coef > 0 else None
        self.owners = engine_owners(cfg.rollout.engine_placement)  # {dp rank: global rank} of each engine
        self.engine = start_engine(cfg, self.tokenizer, self.owners)  # None on ranks that own no engine
        self.transport = make_transport(cfg, self.engine)  # on engine owners (collective: on every rank)
        self.rollout = RolloutManager(cfg, self.tokenizer, self.owners, self.engine, owner_index(self.owners) or 0)
        self.validator = val_set and Validator(cfg, val_set, self.rollout, self.tokenizer, write=self.rank == 0)
        self.saver, self.version = Saver(cfg), 0
        self.start_step = self.restore()
        self.log = RunLogger(cfg, enabled=self.rank == 0, resume_step=self.start_step)  # cut back on resume
        self.update_metrics = []  # per optimizer step of the last rollout step (mini-batches x iterations)
        if self.rank == 0:
            print("\n".join(["data: " + train_set.summary()] + (["eval: " + val_set.summary()] if val_set else [])
                            + [describe_batching(cfg, self.dp)]), flush=True)

    def restore(self) -> int:
        """A resumed run's state from its checkpoint (models, optimizer, LR schedule, RNG, data position, weight
        version). Engines that may hold other weights (any, on resume; remote servers, always) then get the
        trainer's, under the current version, before the first rollout. Returns the first step to run."""
        start = 0
        if self.cfg.checkpoint.resume:
            notes = check_resume(self.cfg)  # the launcher checked already; a trainer built in-process checks here
            common = load_training_state(self.actor, self.cfg.checkpoint.resume, self.cfg)
            self.actor.load_train_state(common["actor"])
            self.prompts.load_state_dict(common["prompts"])
            self.version, start = common["weight_version"], common["step"]
            if self.rank == 0:
                print("\n".join(notes), flush=True)
        if self.cfg.checkpoint.resume or needs_initial_weights(self.cfg):
            self.version -= 1
            self.sync_weights()
        return start

    def rollout_and_score(self, step: int, round_: int = 0) -> list:
        """A fresh batch of prompts, generated and scored by the engines; every rank gets every sample."""
        return self.rollout.rollout(self.prompts.next_batch(), step, round_)  # every rank draws: streams stay in step

    def collect(self, step: int) -> tuple:
        """The step's training samples and their metrics: one round, or DAPO dynamic sampling's several."""
        a = self.cfg.algorithm
        if not a.dynamic_sampling:
            return self.rollout_and_score(step), {}
        draw = lambda round_: self.rollout_and_score(step, round_)  # noqa: E731
        samples, counts = collect(draw, self.cfg.rollout.prompts_per_step, unit_groups(self.cfg, self.dp),
                                  a.max_resample_times, warn=self.rank == 0)
        return samples, counts.metrics()

    def sync_weights(self) -> None:
        """Every DP replica that has an engine exports to it (views, one copy into the engine)."""
        self.version += 1
        push_weights(self.transport, self.actor.models(), self.version, self.owners,
                     self.cfg.rollout.update_bucket_mb << 20)

    def step(self, step: int) -> dict:
        timer, alg = StepTimer(["rollout", "old_logprob", "ref_logprob", "train", "sync"]), self.cfg.algorithm
        with timer("rollout"):
            samples, extra = self.collect(step)
        batch = build_generation_batch(samples, self.cfg, self.tokenizer.pad_token_id, warn=self.rank == 0, step=step)
        for key, actor in (("old_logp", self.actor if batch.needs_old_logprobs else None), ("ref_logp", self.ref)):
            if actor is not None:
                with timer(key.replace("_logp", "_logprob")):
                    batch.set_logprobs(key, actor)
        rewards = batch.rewards
        if self.ref is not None and alg.kl_in_reward:
            seq_kl = sequence_kl(batch)
            rewards = penalize_rewards(rewards, seq_kl, alg.kl_coef)
            extra["actor/kl_ref"] = float(seq_kl[batch.valid].mean()) if batch.valid.any() else 0.0
        adv = compute_advantages(alg.advantage, rewards, batch.group_ids, alg, lengths=batch.lengths)
        batch.set_advantages(adv)
        with timer("train"):
            updates = [self.actor.train_step(mbs) for mbs in batch.updates(self.cfg.train.num_iterations)]
        pause_point("train", step)  # test hook: a kill between the update and the sync
        with timer("sync"):
            self.sync_weights()
        self.log.log_completions(step, samples, adv.tolist(), self.tokenizer, batch.sample_entropies())
        extra["data/epoch"] = self.prompts.epoch
        metrics, self.update_metrics = step_metrics(self.cfg, samples, updates, extra, timer.totals, self.version)
        if self.validator and self.validator.due(step + 1):  # after the sync: the current weights
            metrics.update(self.validator.run(step, self.version))
        return metrics

    def maybe_save(self, done_steps: int) -> None:
        """The whole training state every checkpoint.save_interval steps and at the end (mgrpo/checkpoint.py)."""
        self.saver.poll()
        if self.saver.due(done_steps):
            self.saver.save(self.actor, done_steps, {"step": done_steps, "weight_version": self.version,
                                                     "prompts": self.prompts.state_dict(),
                                                     "actor": self.actor.train_state()})

    def fit(self) -> list:
        log, history = self.log, []
        try:
            if self.validator and self.cfg.eval.before_train and not self.start_step:  # on the initial weights
                log.log_before_training(self.validator.run(-1, self.version))
            for step in range(self.start_step, self.cfg.train.steps):
                metrics = self.step(step)
                history.append(metrics)
                log.log(step, metrics)
                self.maybe_save(step + 1)
            self.saver.close()  # an async save finishes before the run ends
            self.saver.export_hf(self.actor, self.cfg.train.steps)
        finally:
            log.close()
            self.close()
        return history

    def close(self) -> None:
        """Engines (and their processes and buffers) end with the run."""
        for part in (self.transport, self.engine):
            if hasattr(part, "close"):
                part.close()
