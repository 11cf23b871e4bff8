"""The GRPO loop, top to bottom: rollout -> reward -> advantages -> old logprobs -> train -> weight sync.

Engines live on global rank 0 or on the first rank of each DP replica (`rollout.engine_placement`); their
samples reach every rank as JSON bytes, and each replica exports its weights to its own engine.
"""
from __future__ import annotations

from dataclasses import asdict

import torch.distributed as dist

from mgrpo.actor import Actor
from mgrpo.data.batching import build_generation_batch, describe_batching, sequence_kl
from mgrpo.data.dataset import PromptStream, read_prompt_rows
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.logging import RunLogger
from mgrpo.loss.advantages import compute_advantages
from mgrpo.loss.kl import penalize_rewards
from mgrpo.metrics import step_metrics
from mgrpo.parallel.distributed import init_distributed
from mgrpo.parallel.state import setup_model_parallel
from mgrpo.profiling import StepTimer
from mgrpo.resharding.export import export_hf
from mgrpo.rewards.registry import score
from mgrpo.rollout.engine import truncation_warning
from mgrpo.rollout.manager import (RolloutError, RolloutManager, engine_owners, owner_index, push_weights,
                                   share_json, start_engine)
from mgrpo.rollout.types import Sample


class GRPOTrainer:
    def __init__(self, cfg):
        self.cfg = cfg
        init_distributed()
        setup_model_parallel(cfg.parallel, cfg.train.seed)
        self.rank = dist.get_rank()
        self.tokenizer = load_tokenizer(cfg.model.path)
        rows = read_prompt_rows(cfg.data.path, cfg.data.prompt_key, cfg.data.messages_key)
        self.prompts = PromptStream(rows, cfg.rollout.prompts_per_step, cfg.data.shuffle, cfg.train.seed)
        self.actor = Actor(cfg, cfg.model.path)
        self.ref = Actor(cfg, cfg.model.path, train=False) if cfg.algorithm.kl_coef > 0 else None
        self.owners = engine_owners(cfg.rollout.engine_placement)  # {dp rank: global rank} of each engine
        self.engine = start_engine(cfg, self.tokenizer, self.owners)  # None on ranks that own no engine
        if self.rank == 0 and truncation_warning(cfg):
            print(truncation_warning(cfg), flush=True)
        self.transport = self.engine.weight_transport(cfg.rollout.update_bucket_mb << 20) if self.engine else None
        self.rollout = RolloutManager(cfg, self.tokenizer, self.owners, self.engine, owner_index(self.owners) or 0)
        self.version = 0
        self.log = RunLogger(cfg, enabled=self.rank == 0)  # metrics.jsonl, TensorBoard, wandb, completions
        self.update_metrics = []  # per optimizer step of the last rollout step (mini-batches x iterations)
        if self.rank == 0:
            dp = dist.get_world_size() // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
            print(describe_batching(cfg, dp), flush=True)

    def rollout_and_score(self, step: int) -> list:
        """Each engine owner generates and scores its share; every rank gets every sample (or the first error)."""
        rows = self.prompts.next_batch()  # every rank draws, so the data stream stays in step
        payload = {"samples": []}
        if self.engine is not None:
            try:
                samples = self.rollout.generate_share(rows, step)
                score(samples, self.tokenizer, self.cfg.reward.funcs, self.cfg.reward.weights, self.cfg.reward.kwargs)
                payload = {"samples": [asdict(s) for s in samples]}
            except Exception as exc:  # every rank must leave the collective below, then fail together
                payload = {"error": f"step {step}: {type(exc).__name__}: {exc}"}
        gathered = share_json(payload, list(self.owners.values()))
        errors = [p["error"] for p in gathered if "error" in p]
        if errors:
            raise RolloutError(errors[0])
        return sorted((Sample(**d) for p in gathered for d in p["samples"]), key=lambda s: s.group_id)

    def sync_weights(self) -> None:
        """Every DP replica that has an engine exports to it (views, one copy into the engine)."""
        self.version += 1
        tensors = export_hf(self.actor.models(), dst=self.owners, bucket_bytes=self.cfg.rollout.update_bucket_mb << 20)
        push_weights(self.transport, tensors, self.version, list(self.owners.values()))

    def step(self, step: int) -> dict:
        timer, alg = StepTimer(["rollout", "old_logprob", "ref_logprob", "train", "sync"]), self.cfg.algorithm
        with timer("rollout"):
            samples = self.rollout_and_score(step)
        batch = build_generation_batch(samples, self.cfg, self.tokenizer.pad_token_id, warn=self.rank == 0)
        for key, actor in (("old_logp", self.actor if batch.needs_old_logprobs else None), ("ref_logp", self.ref)):
            if actor is not None:
                with timer(key.replace("_logp", "_logprob")):
                    batch.set_logprobs(key, actor)
        rewards, extra = batch.rewards, {}
        if self.ref is not None and alg.kl_in_reward:
            seq_kl = sequence_kl(batch)
            rewards = penalize_rewards(rewards, seq_kl, alg.kl_coef)
            extra["actor/kl_ref"] = float(seq_kl[batch.valid].mean()) if batch.valid.any() else 0.0
        adv = compute_advantages(alg.advantage, rewards, batch.group_ids, alg, lengths=batch.lengths)
        batch.set_advantages(adv)
        with timer("train"):
            updates = [self.actor.train_step(mbs) for mbs in batch.updates(self.cfg.train.num_iterations)]
        with timer("sync"):
            self.sync_weights()
        self.log.log_completions(step, samples, adv.tolist(), self.tokenizer)
        metrics, self.update_metrics = step_metrics(self.cfg, samples, updates, extra, timer.totals, self.version)
        return metrics

    def maybe_save(self, done_steps: int) -> None:
        c = self.cfg.checkpoint
        if c.save_dir and c.save_interval > 0 and (done_steps % c.save_interval == 0
                                                   or done_steps == self.cfg.train.steps):
            from mgrpo.checkpoint import save_checkpoint

            save_checkpoint(self.actor.chunks, self.cfg, done_steps, c.save_dir, self.cfg.model.path)

    def fit(self) -> list:
        log, history = self.log, []
        try:
            for step in range(self.cfg.train.steps):
                metrics = self.step(step)
                history.append(metrics)
                log.log(step, metrics)
                self.maybe_save(step + 1)
        finally:
            log.close()
            self.close()
        return history

    def close(self) -> None:
        """Engines (and their processes and buffers) end with the run."""
        for part in (self.transport, self.engine):
            if hasattr(part, "close"):
                part.close()
