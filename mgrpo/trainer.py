"""The GRPO loop, top to bottom: rollout -> reward -> advantages -> old logprobs -> train -> weight sync.

Rank 0 owns the rollout engine (TP/PP/DP ranks share it); samples travel to every rank as JSON bytes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.actor import Actor
from mgrpo.data.dataset import PromptStream, read_prompt_rows
from mgrpo.data.microbatch import dp_shard, make_microbatches
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.logging import RunLogger
from mgrpo.loss.registry import advantages
from mgrpo.parallel.distributed import init_distributed
from mgrpo.parallel.state import setup_model_parallel
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


def reduce_last_stage(metrics: dict, keys: list) -> dict:
    """Metrics live on last-stage ranks; average them over DP (token-weighted) and bring them to every rank."""
    report = mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0 \
        and mpu.get_context_parallel_rank() == 0
    tokens = metrics.get("tokens", 0.0) if report else 0.0
    vec = torch.tensor([metrics.get(k, 0.0) * tokens if report else 0.0 for k in keys] + [tokens], dtype=torch.float64)
    dist.all_reduce(vec)
    return {k: float(v) / max(float(vec[-1]), 1.0) for k, v in zip(keys, vec[:-1])}


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
        self.engine = make_engine(cfg, cfg.model.path, self.tokenizer) if self.rank == 0 else None
        self.rollout = RolloutManager(self.engine, self.tokenizer, cfg) if self.rank == 0 else None
        self.version = 0
        self.pad_multiple = cfg.parallel.tp if cfg.parallel.sp else 1

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
        t0 = time.perf_counter()
        samples = self.rollout_and_score(step)
        t1 = time.perf_counter()
        alg = self.cfg.algorithm
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        adv = advantages(alg.advantage)(rewards, torch.tensor([s.group_id for s in samples]), alg)
        dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        local = dp_shard(list(range(len(samples))), dp_rank, dp_size)
        mbs = make_microbatches([samples[i] for i in local], self.cfg.train.micro_batch_size,
                                self.tokenizer.pad_token_id, [adv[i] for i in local], self.pad_multiple,
                                same_length=self.cfg.parallel.pp > 1)
        old = self.actor.logprobs(mbs)
        for i, mb in enumerate(mbs):
            mb["old_logp"] = old[i] if old else torch.zeros_like(mb["loss_mask"])
        global_tokens = sum(sum(s.loss_mask) for s in samples)
        train = self.actor.train_step(mbs, global_tokens)
        t2 = time.perf_counter()
        self.sync_weights()
        t3 = time.perf_counter()
        metrics = reduce_last_stage(train, ["loss", "clip_frac", "approx_kl"])
        n_tokens = sum(len(s.response_ids) for s in samples)
        metrics.update(reward_mean=float(rewards.nanmean()), reward_std=float(rewards[~rewards.isnan()].std()),
                       response_len=n_tokens / len(samples), grad_norm=train["grad_norm"],
                       tokens_per_s=n_tokens / (t3 - t0), time_rollout=t1 - t0, time_train=t2 - t1,
                       time_sync=t3 - t2, weight_version=self.version)
        return metrics

    def fit(self) -> list:
        log = RunLogger(self.cfg.logging.output_dir, self.cfg.train.steps, enabled=self.rank == 0,
                        progress_bar=self.cfg.logging.progress_bar)
        history = []
        try:
            for step in range(self.cfg.train.steps):
                metrics = self.step(step)
                history.append(metrics)
                log.log(step, metrics)
        finally:
            log.close()
        return history
