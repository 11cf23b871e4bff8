"""The GRPO loop, top to bottom: rollout -> reward -> advantages -> old logprobs -> train -> weight sync.

Rank 0 owns the rollout engine (TP/PP/DP ranks share it); samples travel to every rank as JSON bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mgrpo.actor import Actor
from mgrpo.data.batching import build_train_batch, sequence_kl
from mgrpo.data.dataset import PromptStream, read_prompt_rows
from mgrpo.data.microbatch import set_advantages
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.logging import RunLogger
from mgrpo.loss.advantages import compute_advantages
from mgrpo.loss.kl import penalize_rewards
from mgrpo.metrics import step_metrics
from mgrpo.parallel.distributed import init_distributed
from mgrpo.parallel.state import setup_model_parallel
from mgrpo.profiling import StepTimer
from mgrpo.resharding.bucket import make_buckets
from mgrpo.resharding.export import export_hf
from mgrpo.rewards.registry import score
from mgrpo.rollout.engine import make_engine
from mgrpo.rollout.manager import RolloutManager
from mgrpo.rollout.types import samples_from_bytes, samples_to_bytes


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
    dist.broadcast(n, src)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src)
    return data if data is not None else bytes(buf.numpy())


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
        self.engine = make_engine(cfg, cfg.model.path, self.tokenizer) if self.rank == 0 else None
        self.rollout = RolloutManager(self.engine, self.tokenizer, cfg) if self.rank == 0 else None
        self.version = 0
        self.log = RunLogger(cfg, enabled=self.rank == 0)  # metrics.jsonl, TensorBoard, wandb, completions

    def rollout_and_score(self, step: int) -> list:
        data = None
        if self.rank == 0:
            samples = self.rollout.generate(self.prompts.next_batch(), step, self.version)
            r = self.cfg.reward
            score(samples, self.tokenizer, r.funcs, r.weights, r.kwargs)
            data = samples_to_bytes(samples)
        else:
            self.prompts.next_batch()  # keep every rank's data stream in step
        return samples_from_bytes(broadcast_bytes(data))

    def sync_weights(self) -> None:
        self.version += 1
        tensors = export_hf(self.actor.models(), dst=0, bucket_bytes=self.cfg.rollout.update_bucket_mb << 20)
        if self.engine is not None:
            buckets = make_buckets(tensors, self.cfg.rollout.update_bucket_mb << 20, self.version, checksum=False)
            self.engine.update_weights(buckets, self.version)
        else:
            for _ in tensors:
                pass

    def step(self, step: int) -> dict:
        timer, alg = StepTimer(["rollout", "old_logprob", "ref_logprob", "train", "sync"]), self.cfg.algorithm
        with timer("rollout"):
            samples = self.rollout_and_score(step)
        batch = build_train_batch(samples, self.cfg, self.tokenizer.pad_token_id, warn=self.rank == 0)
        for key, actor in (("old_logp", self.actor), ("ref_logp", self.ref)):
            if actor is not None:
                with timer(key.replace("_logp", "_logprob")):
                    batch.set_logprobs(key, actor.logprobs(batch.microbatches))
        rewards, extra = batch.rewards, {}
        if self.ref is not None and alg.kl_in_reward:
            seq_kl = sequence_kl(batch)
            rewards = penalize_rewards(rewards, seq_kl, alg.kl_coef)
            extra["actor/kl_ref"] = float(seq_kl[batch.valid].mean()) if batch.valid.any() else 0.0
        adv = compute_advantages(alg.advantage, rewards, batch.group_ids, alg, lengths=batch.lengths)
        set_advantages(batch.microbatches, [adv[i] for i in batch.local])
        with timer("train"):
            train = self.actor.train_step(batch.microbatches)
        with timer("sync"):
            self.sync_weights()
        self.log.log_completions(step, samples, adv.tolist(), self.tokenizer)
        return step_metrics(self.cfg, samples, train, extra, timer.totals, self.version)

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
        return history
