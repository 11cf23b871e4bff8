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
from mgrpo.data.microbatch import dp_shard, make_microbatches, set_advantages
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.logging import RunLogger
from mgrpo.loss.advantages import valid_mask
from mgrpo.loss.aggregation import token_weights
from mgrpo.loss.kl import penalize_rewards
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


def _reports() -> bool:
    """Last-stage TP0 ranks hold the metrics (every CP rank its own tokens' share)."""
    return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0


def reduce_last_stage(metrics: dict, mean_keys: list, sum_keys: list) -> dict:
    """Metrics live on last-stage ranks: token-weighted means of `mean_keys`, sums of `sum_keys`, on every rank."""
    report = _reports()
    tokens = metrics.get("tokens", 0.0) if report else 0.0
    vec = torch.tensor([metrics.get(k, 0.0) * tokens if report else 0.0 for k in mean_keys]
                       + [metrics.get(k, 0.0) if report else 0.0 for k in sum_keys] + [tokens], dtype=torch.float64)
    dist.all_reduce(vec)
    out = {k: float(v) / max(float(vec[-1]), 1.0) for k, v in zip(mean_keys, vec)}
    out.update({k: float(v) for k, v in zip(sum_keys, vec[len(mean_keys):])})
    return out


def sequence_kl(microbatches: list, offset: int, n_global: int) -> torch.Tensor:
    """Per-sample sum of k1 = old - ref logprob over response tokens (CP ranks add their chunks), on every rank."""
    out = torch.zeros(n_global, dtype=torch.float64)
    if _reports():
        for mb in microbatches:
            kl = ((mb["old_logp"] - mb["ref_logp"]) * mb["loss_mask"]).sum(-1)
            for row, idx in enumerate(mb["sample_index"]):
                out[offset + idx] = float(kl[row])
    dist.all_reduce(out)
    return out


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
        alg, n = self.cfg.algorithm, len(samples)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        for s, ok in zip(samples, valid_mask(rewards).tolist()):
            if not ok:  # a failed reward trains nothing
                s.loss_mask = [0] * len(s.loss_mask)
        weights = token_weights(samples, alg.aggregation, self.cfg.rollout.max_tokens)
        dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        local = dp_shard(list(range(n)), dp_rank, dp_size)
        mbs = make_microbatches([samples[i] for i in local], self.cfg.train.micro_batch_size,
                                self.tokenizer.pad_token_id, None, self.pad_multiple,
                                same_length=self.cfg.parallel.pp > 1, token_weights=[weights[i] for i in local],
                                cp_rank=mpu.get_context_parallel_rank(), cp_size=self.cfg.parallel.cp)
        for key, actor in (("old_logp", self.actor), ("ref_logp", self.ref)):
            if actor is not None:
                logps = actor.logprobs(mbs)
                for i, mb in enumerate(mbs):
                    mb[key] = logps[i] if logps else torch.zeros_like(mb["loss_mask"])
        kl_metrics = {}
        if self.ref is not None and alg.kl_in_reward:
            seq_kl = sequence_kl(mbs, local[0], n)
            rewards = penalize_rewards(rewards, seq_kl, alg.kl_coef)
            kl_metrics["kl_ref"] = float(seq_kl.mean())
        adv = advantages(alg.advantage)(rewards, torch.tensor([s.group_id for s in samples]), alg)
        set_advantages(mbs, [adv[i] for i in local])
        train = self.actor.train_step(mbs)
        t2 = time.perf_counter()
        self.sync_weights()
        t3 = time.perf_counter()
        metrics = reduce_last_stage(train, self.metric_keys(), ["loss"])
        n_tokens = sum(len(s.response_ids) for s in samples)
        raw = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        metrics.update(kl_metrics, reward_mean=float(raw.nanmean()), reward_std=float(raw[~raw.isnan()].std()),
                       response_len=n_tokens / n, grad_norm=train["grad_norm"], tokens_per_s=n_tokens / (t3 - t0),
                       time_rollout=t1 - t0, time_train=t2 - t1, time_sync=t3 - t2, weight_version=self.version)
        return metrics

    def metric_keys(self) -> list:
        """The same list on every rank (only last-stage ranks hold the values): a collective needs equal sizes."""
        alg = self.cfg.algorithm
        keys = ["clip_frac", "approx_kl"] + (["entropy"] if alg.entropy_coef > 0 else [])
        if alg.rollout_is_mode:
            kind = "clip" if alg.rollout_is_mode.endswith(("truncate", "tis")) else "mask"
            keys += [f"rollout_is/{k}" for k in ("rollout_logp_abs_diff", "rollout_kl_k1", "rollout_kl_k3",
                                                 "rollout_is_weight_mean", f"rollout_is_{kind}_frac")]
        return keys

    def maybe_save(self, done_steps: int) -> None:
        c = self.cfg.checkpoint
        if c.save_dir and c.save_interval > 0 and (done_steps % c.save_interval == 0
                                                   or done_steps == self.cfg.train.steps):
            from mgrpo.checkpoint import save_checkpoint

            save_checkpoint(self.actor.chunks, self.cfg, done_steps, c.save_dir, self.cfg.model.path)

    def fit(self) -> list:
        log = RunLogger(self.cfg.logging.output_dir, self.cfg.train.steps, enabled=self.rank == 0,
                        progress_bar=self.cfg.logging.progress_bar)
        history = []
        try:
            for step in range(self.cfg.train.steps):
                metrics = self.step(step)
                history.append(metrics)
                log.log(step, metrics)
                self.maybe_save(step + 1)
        finally:
            log.close()
        return history
