"""Generation batch -> mini-batches -> this rank's micro-batches.

`rollout.prompts_per_step x rollout.n` samples (fewer with dynamic sampling) form a generation batch; it is cut
into `train.steps_per_generation` contiguous mini-batches (one optimizer step each), replayed
`train.num_iterations` times. Failed samples (NaN reward), dynamic sampling's padding groups and, with
`algorithm.overlong_filter`, truncated ones train nothing: they leave the aggregation counts and the advantages'
group statistics. Each mini-batch's aggregation weights come from its own global counts; each mini-batch is sharded
over DP and cut into micro-batches (CP split inside).
Old logprobs are needed only when the buffer is reused (or for the KL-in-reward penalty): with one update per
generation batch they equal the current policy's, and the loss uses its own logprobs, detached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as mpu

from mgrpo.data.dynamic_sampling import PADDING
from mgrpo.data.microbatch import dp_shard, make_microbatches, set_advantages
from mgrpo.loss.advantages import valid_mask
from mgrpo.loss.aggregation import token_weights
from mgrpo.loss.policy import aggregation_of
from mgrpo.parallel.device import device

log = logging.getLogger("mgrpo.batching")


@dataclass
class MiniBatch:
    microbatches: list  # this rank's
    local: list  # global sample indices of this DP rank's share, in micro-batch order


@dataclass
class GenerationBatch:
    samples: list
    minibatches: list
    rewards: torch.Tensor  # float64 [N], NaN where the reward failed
    valid: torch.Tensor  # bool [N]: the reward is finite
    trained: torch.Tensor  # bool [N]: valid, and neither overlong-filtered nor dynamic-sampling padding
    group_ids: torch.Tensor
    lengths: list  # loss tokens per sample (0 for failed samples)
    needs_old_logprobs: bool
    entropy_quantile: float = 1.0  # < 1: the top-entropy token mask (loss/entropy_mask.py)
    log_entropy: bool = False  # per-token entropies for completions.jsonl this step

    def trained_rewards(self) -> torch.Tensor:
        """The rewards the advantages see: NaN for samples that train nothing, so they leave every group mean and
        std (DAPO: an overlong-filtered answer is neither right nor wrong; padding groups carry no signal)."""
        return torch.where(self.trained, self.rewards, torch.full_like(self.rewards, float("nan")))

    def set_logprobs(self, key: str, actor) -> None:
        """`actor`'s logprobs for every micro-batch of every mini-batch (only last-stage ranks get any; zeros
        stand in elsewhere). Runs before the first update, so old logprobs are the rollout policy's. The old
        pass also gives the entropies (same fused kernel) when the entropy mask or the entropy log wants them."""
        entropy = key == "old_logp" and (self.entropy_quantile < 1 or self.log_entropy)
        for mini in self.minibatches:
            logps, ents = (
                actor.logprobs(mini.microbatches, entropy=True)
                if entropy
                else (actor.logprobs(mini.microbatches), None)
            )
            for i, mb in enumerate(mini.microbatches):
                mb[key] = logps[i] if logps else torch.zeros_like(mb["loss_mask"])
                if ents:
                    mb["entropy"] = ents[i]
            if ents and self.entropy_quantile < 1:  # last-stage ranks, each with its DP x CP group
                from mgrpo.loss.entropy_mask import set_entropy_masks

                set_entropy_masks(
                    mini.microbatches, self.entropy_quantile, mpu.get_data_parallel_group(with_context_parallel=True)
                )

    def sample_entropies(self) -> list | None:
        """Each sample's per-token entropy over its response (None where the loss mask is 0), on every rank;
        None when not asked for this step. A collective over the CPU group."""
        if not self.log_entropy:
            return None
        import torch.distributed as dist

        from mgrpo.parallel.device import cpu_group
        from mgrpo.parallel.state import holds_metrics

        width = max([len(s.response_ids) for s in self.samples] + [1])
        out = torch.zeros(len(self.samples), width, dtype=torch.float64)
        if holds_metrics():  # last stage, TP rank 0: every DP and CP rank adds its own tokens
            for mini in self.minibatches:
                for mb in mini.microbatches:
                    ent, on, pos = (mb[k].detach().cpu() for k in ("entropy", "loss_mask", "position_ids"))
                    for row, idx in enumerate(mb["sample_index"]):
                        i = mini.local[idx]
                        cols = on[row].nonzero().flatten()  # logits at position p predict token p + 1
                        out[i, pos[row, cols] + 1 - len(self.samples[i].prompt_ids)] = ent[row, cols].double()
        dist.all_reduce(out, group=cpu_group())
        return [
            [round(float(out[i, j]), 4) if on else None for j, on in enumerate(s.loss_mask)]
            for i, s in enumerate(self.samples)
        ]

    def set_advantages(self, advantages) -> None:
        for mini in self.minibatches:
            set_advantages(mini.microbatches, [advantages[i] for i in mini.local])

    def updates(self, num_iterations: int) -> list:
        """The micro-batch lists of every optimizer step, in order: each mini-batch, the whole buffer replayed."""
        return [mini.microbatches for _ in range(num_iterations) for mini in self.minibatches]


def missing_rollout_logprobs(samples: list) -> int:
    return sum(1 for s in samples if s.rollout_logprobs is None)


def describe_batching(cfg, dp: int) -> str:
    """The batch arithmetic in one line, for the start-up log."""
    t, r = cfg.train, cfg.rollout
    total = r.prompts_per_step * r.n
    mini = total // t.steps_per_generation
    per_dp = mini // dp
    mbs = min(t.micro_batch_size, per_dp)
    updates = t.steps_per_generation * t.num_iterations
    old = (
        "old logprobs computed once per rollout"
        if updates > 1
        else "old logprobs skipped (one update per rollout: they equal the current policy's)"
    )
    micro = f"{-(-per_dp // mbs)} micro-batch(es) of <= {mbs}"
    if t.max_tokens_per_microbatch:
        micro = f"micro-batches of <= {t.max_tokens_per_microbatch} tokens (DP shares balanced by tokens)"
    if t.sequence_packing:
        micro += ", each one packed row (padding-free)"
    return (
        f"batching: {total} samples -> {t.steps_per_generation} mini-batch(es) of {mini} x {t.num_iterations} "
        f"iteration(s) -> {updates} optimizer step(s) per rollout; {dp} DP rank(s) x {micro}; {old}"
    )


def build_generation_batch(
    samples: list, cfg, pad_id: int, warn: bool = True, step: int | None = None
) -> GenerationBatch:
    """The step's samples as mini-batches of this rank's micro-batches; `step` (the trainer's) decides whether
    completions.jsonl wants per-token entropies this step (logging.log_entropy)."""
    log_entropy = step is not None and entropy_due(cfg.logging, step)
    alg, t = cfg.algorithm, cfg.train
    rewards = torch.tensor([s.reward if s.reward is not None else float("nan") for s in samples], dtype=torch.float64)
    valid = valid_mask(rewards)
    trained, overlong = valid.clone(), 0
    for k, s in enumerate(samples):
        if alg.overlong_filter and s.finish_reason == "length":
            trained[k], overlong = False, overlong + 1  # DAPO: a truncated answer is neither right nor wrong
        if s.info.get(PADDING):  # dynamic sampling's top-up to an evenly divisible batch (data/dynamic_sampling.py)
            trained[k] = False
        if not trained[k]:  # a failed reward, a filtered truncation or padding trains nothing
            s.loss_mask = [0] * len(s.loss_mask)
    if overlong == len(samples) and warn:
        log.warning(
            "all %d samples stopped at rollout.max_tokens=%d and algorithm.overlong_filter masks them: this "
            "step trains nothing (zero gradients). Raise rollout.max_tokens or turn overlong_filter off",
            len(samples),
            cfg.rollout.max_tokens,
        )
    missing = missing_rollout_logprobs(samples)
    if missing and alg.rollout_is_mode and warn:
        log.warning(
            "%d of %d samples have no rollout logprobs: they are left out of the rollout IS correction "
            "(weight 1) and of the rollout_is/* metrics",
            missing,
            len(samples),
        )
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    size = len(samples) // t.steps_per_generation
    minis = []
    for k in range(t.steps_per_generation):
        idx = list(range(k * size, (k + 1) * size))
        chunk = [samples[i] for i in idx]
        weights = token_weights(chunk, aggregation_of(alg), cfg.rollout.max_tokens, include=trained[idx].tolist())
        local, groups = this_rank_share(chunk, t, dp_rank, dp)
        mbs = make_microbatches(
            [chunk[i] for i in local],
            t.micro_batch_size,
            pad_id,
            None,
            cfg.parallel.tp if cfg.parallel.sp else 1,
            same_length=cfg.parallel.pp > 1,
            token_weights=[weights[i] for i in local],
            cp_rank=mpu.get_context_parallel_rank(),
            cp_size=cfg.parallel.cp,
            device=device(),
            groups=groups,
            packing=t.sequence_packing,
        )
        minis.append(MiniBatch(mbs, [idx[i] for i in local]))
    needs_old = (
        t.steps_per_generation * t.num_iterations > 1
        or (alg.kl_in_reward and alg.kl_coef > 0)
        or alg.top_entropy_quantile < 1
        or log_entropy
    )  # entropies come from the old-logprob pass
    return GenerationBatch(
        samples,
        minis,
        rewards,
        valid,
        trained,
        torch.tensor([s.group_id for s in samples]),
        [sum(s.loss_mask) for s in samples],
        needs_old,
        alg.top_entropy_quantile,
        log_entropy,
    )


def this_rank_share(chunk: list, t, dp_rank: int, dp: int) -> tuple:
    """(indices of this DP rank's samples in `chunk`, micro-batch groups or None). With a token budget or packing
    the DP shares balance tokens (equal counts); the budget then groups them (data/packing.py)."""
    if not (t.max_tokens_per_microbatch or t.sequence_packing):
        return dp_shard(list(range(len(chunk))), dp_rank, dp), None
    from mgrpo.data.packing import balanced_dp_shard, budget_groups

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in chunk]
    local = balanced_dp_shard(lengths, dp_rank, dp)
    if not t.max_tokens_per_microbatch:
        return local, None
    return local, budget_groups([lengths[i] for i in local], t.max_tokens_per_microbatch, t.sequence_packing)


def generation_batch_kl(batch: GenerationBatch) -> torch.Tensor:
    """Per-sample sum of k1 = old - ref logprob over loss tokens (loss.kl.sequence_kl on each micro-batch; CP ranks
    add their chunks), on every rank: the penalty of algorithm.kl_in_reward."""
    import torch.distributed as dist

    from mgrpo.loss.kl import sequence_kl
    from mgrpo.parallel.device import cpu_group
    from mgrpo.parallel.state import holds_metrics

    out = torch.zeros(len(batch.samples), dtype=torch.float64)
    if holds_metrics():
        for mini in batch.minibatches:
            for mb in mini.microbatches:
                kl = sequence_kl(mb["old_logp"], mb["ref_logp"], mb["loss_mask"])
                for row, idx in enumerate(mb["sample_index"]):
                    out[mini.local[idx]] = float(kl[row])
    dist.all_reduce(out, group=cpu_group())
    return out


def entropy_due(g, step: int) -> bool:
    """Whether this step's completions carry per-token entropies (the same answer on every rank)."""
    return bool(g.log_entropy and g.completions_interval and step % g.completions_interval == 0)
