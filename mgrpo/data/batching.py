"""Generation batch -> this rank's micro-batches: failed samples out, aggregation weights from global counts,
DP shard, micro-batches (CP split inside), and the per-sample facts the advantage estimators need."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as mpu

from mgrpo.data.microbatch import dp_shard, make_microbatches
from mgrpo.loss.advantages import valid_mask
from mgrpo.loss.aggregation import token_weights

log = logging.getLogger("mgrpo.batching")


@dataclass
class TrainBatch:
    samples: list
    microbatches: list
    local: list  # global indices of this DP rank's samples
    rewards: torch.Tensor  # float64 [N], NaN where the reward failed
    valid: torch.Tensor  # bool [N]: the reward is finite
    group_ids: torch.Tensor
    lengths: list  # loss tokens per sample (0 for failed samples)

    def set_logprobs(self, key: str, logps: list) -> None:
        """Store per-micro-batch logprobs (only last-stage ranks get any; zeros stand in elsewhere)."""
        for i, mb in enumerate(self.microbatches):
            mb[key] = logps[i] if logps else torch.zeros_like(mb["loss_mask"])


def missing_rollout_logprobs(samples: list) -> int:
    return sum(1 for s in samples if s.rollout_logprobs is None)


def build_train_batch(samples: list, cfg, pad_id: int, warn: bool = True) -> TrainBatch:
    """A failed reward (NaN) trains nothing: its loss mask becomes 0 and it leaves the aggregation counts."""
    alg = cfg.algorithm
    rewards = torch.tensor([s.reward if s.reward is not None else float("nan") for s in samples],
                           dtype=torch.float64)
    valid = valid_mask(rewards)
    for s, ok in zip(samples, valid.tolist()):
        if not ok:
            s.loss_mask = [0] * len(s.loss_mask)
    missing = missing_rollout_logprobs(samples)
    if missing and alg.rollout_is_mode and warn:
        log.warning("%d of %d samples have no rollout logprobs: they are left out of the rollout IS correction "
                    "(weight 1) and of the rollout_is/* metrics", missing, len(samples))
    weights = token_weights(samples, alg.aggregation, cfg.rollout.max_tokens, include=valid.tolist())
    local = dp_shard(list(range(len(samples))), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    mbs = make_microbatches([samples[i] for i in local], cfg.train.micro_batch_size, pad_id, None,
                            cfg.parallel.tp if cfg.parallel.sp else 1, same_length=cfg.parallel.pp > 1,
                            token_weights=[weights[i] for i in local], cp_rank=mpu.get_context_parallel_rank(),
                            cp_size=cfg.parallel.cp)
    return TrainBatch(samples, mbs, local, rewards, valid, torch.tensor([s.group_id for s in samples]),
                      [sum(s.loss_mask) for s in samples])


def sequence_kl(batch: TrainBatch) -> torch.Tensor:
    """Per-sample sum of k1 = old - ref logprob over loss tokens (CP ranks add their chunks), on every rank."""
    import torch.distributed as dist

    from mgrpo.metrics import holds_metrics

    out = torch.zeros(len(batch.samples), dtype=torch.float64)
    if holds_metrics():
        for mb in batch.microbatches:
            kl = ((mb["old_logp"] - mb["ref_logp"]) * mb["loss_mask"]).sum(-1)
            for row, idx in enumerate(mb["sample_index"]):
                out[batch.local[idx]] = float(kl[row])
    dist.all_reduce(out)
    return out
