"""Run one fixed GRPO batch at a given layout and save loss, full HF-named gradients and post-step weights.

Used by the layout-matrix tests (and handy for checking a new cluster layout by hand): every layout's
files must equal the TP1 run's. Files are written by the ranks that own each tensor (TP rank 0, DP rank 0).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.data.microbatch import dp_shard, make_microbatches
from mgrpo.resharding.export import full_hf_tensors


def run_layout(cfg, model_dir: str, samples: list, out_dir: str, tag: str, corrupt=None) -> None:
    """Forward+backward of `samples` (old logprobs = their rollout_logprobs), then one optimizer step."""
    from mgrpo.actor import Actor
    from mgrpo.parallel.state import setup_model_parallel

    setup_model_parallel(cfg.parallel, cfg.train.seed)
    actor = Actor(cfg, model_dir)
    if corrupt is not None:
        corrupt(actor)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    local = [samples[i] for i in dp_shard(list(range(len(samples))), dp_rank, dp_size)]
    advs = [s.info["advantage"] for s in local]
    pad = cfg.parallel.tp if cfg.parallel.sp else 1
    mbs = make_microbatches(local, cfg.train.micro_batch_size, 0, advs, pad, same_length=cfg.parallel.pp > 1)
    for mb in mbs:
        mb["old_logp"] = mb["rollout_logp"]
    global_tokens = sum(sum(s.loss_mask) for s in samples)
    stats = actor.forward_backward(mbs, global_tokens)
    owner = mpu.get_tensor_model_parallel_rank() == 0 and dp_rank == 0 and mpu.get_context_parallel_rank() == 0
    loss = torch.tensor([sum(float(s["loss_sum"]) for s in stats) / global_tokens if stats else 0.0],
                        dtype=torch.float64)
    dist.all_reduce(loss, group=mpu.get_data_parallel_group(with_context_parallel=True))
    dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())  # only the last stage has a loss
    use_dist_opt = cfg.train.use_distributed_optimizer
    grads = {} if use_dist_opt else dict(full_hf_tensors(actor.chunks, lambda p: p.main_grad.clone()))
    actor.optimizer.step()
    weights = dict(full_hf_tensors(actor.chunks))
    if owner:
        stage = mpu.get_pipeline_model_parallel_rank()
        torch.save({"loss": float(loss), "grads": grads, "weights": weights},
                   os.path.join(out_dir, f"{tag}.pp{stage}.pt"))
    dist.barrier()


def load_layout(out_dir: str, tag: str) -> dict:
    """Merge the per-stage files of one layout into {'loss', 'grads', 'weights'}."""
    merged = {"loss": None, "grads": {}, "weights": {}}
    files = sorted(f for f in os.listdir(out_dir) if f.startswith(tag + ".pp"))
    if not files:
        raise FileNotFoundError(f"no results for layout {tag} in {out_dir}")
    for f in files:
        part = torch.load(os.path.join(out_dir, f), weights_only=True)
        merged["loss"] = part["loss"]
        merged["grads"].update(part["grads"])
        merged["weights"].update(part["weights"])
    return merged
