"""Layout checks: run a fixed GRPO batch (or an export) at a given layout and save what TP1 must match.

Used by the layout-matrix and resharding tests, and handy for checking a new cluster layout by hand.
Files: `{tag}.pp{stage}.pt` (HF-named gradients of that stage, written by its TP0/DP0 rank) and
`{tag}.export.pt` (loss and the post-step weights as `export_hf` streams them to global rank 0).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.data.batching import this_rank_share
from mgrpo.data.microbatch import dp_shard, make_microbatches
from mgrpo.loss.aggregation import token_weights
from mgrpo.loss.policy import aggregation_of
from mgrpo.models.lora import has_lora, peft_tensors
from mgrpo.weights.export import export_hf, full_hf_tensors


def _owner() -> bool:
    return (
        mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_data_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
    )


def _export_to_rank0(chunks, bucket_bytes=1 << 20) -> dict:
    out = {}
    for name, t in export_hf(chunks, dst=0, bucket_bytes=bucket_bytes):
        out[name] = t.clone()
    return out


def run_layout(
    cfg,
    model_dir: str,
    samples: list,
    out_dir: str,
    tag: str,
    corrupt=None,
    save_to=None,
    weights_fn=None,
    step: bool = True,
    gloo_groups: bool | None = None,
    entropy_per_rank: bool = False,
) -> None:
    """Forward+backward of `samples` (old logprobs = their rollout_logprobs), then one optimizer step.

    `weights_fn(samples)` replaces the configured aggregation weights (negative controls); `gloo_groups=False`
    builds megatron's groups as under CUDA with nccl (no gloo DP groups). With
    `algorithm.top_entropy_quantile < 1` the entropy mask is set as the trainer sets it (`entropy_per_rank`: each
    rank's own quantile, a negative control)."""
    from mgrpo.actor import Actor
    from mgrpo.parallel.state import gloo_groups_created, setup_model_parallel

    setup_model_parallel(cfg.parallel, cfg.train.seed, gloo_groups=gloo_groups)
    if gloo_groups is not None and gloo_groups_created() != gloo_groups:
        raise RuntimeError(f"asked for gloo DP groups={gloo_groups}, megatron made {gloo_groups_created()}")
    actor = Actor(cfg, model_dir)
    if corrupt is not None:
        corrupt(actor)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    idx, groups = this_rank_share(samples, cfg.train, dp_rank, dp_size)  # the trainer's DP split and micro-batches
    local = [samples[i] for i in idx]
    advs = [s.info["advantage"] for s in local]
    weights = (
        weights_fn(samples)
        if weights_fn
        else token_weights(samples, aggregation_of(cfg.algorithm), cfg.rollout.max_tokens)
    )
    pad = cfg.parallel.tp if cfg.parallel.sp else 1
    mbs = make_microbatches(
        local,
        cfg.train.micro_batch_size,
        0,
        advs,
        pad,
        same_length=cfg.parallel.pp > 1,
        token_weights=[weights[i] for i in idx],
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cfg.parallel.cp,
        groups=groups,
        packing=cfg.train.sequence_packing,
    )
    for mb in mbs:
        mb["old_logp"] = mb["rollout_logp"]
    if cfg.algorithm.top_entropy_quantile < 1:
        _set_entropy_masks(actor, mbs, cfg.algorithm.top_entropy_quantile, entropy_per_rank)
    stats = actor.forward_backward(mbs)
    loss = torch.tensor([sum(float(s["loss_sum"]) for s in stats)], dtype=torch.float64)
    dist.all_reduce(loss, group=mpu.get_data_parallel_group(with_context_parallel=True))
    dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())  # only the last stage has a loss
    if not cfg.train.use_distributed_optimizer:  # its grad buffers hold reduce-scattered shards only
        main_grad = lambda p: p.main_grad.clone()  # noqa: E731
        grads = dict(
            peft_tensors(actor.models(), main_grad)
            if has_lora(actor.models())
            else full_hf_tensors(actor.chunks, main_grad)
        )  # LoRA: the base is frozen, the adapters train
        if _owner():
            torch.save({"grads": grads}, os.path.join(out_dir, f"{tag}.pp{mpu.get_pipeline_model_parallel_rank()}.pt"))
    if step:
        actor.optimizer.step()
    exported = _export_to_rank0(actor.chunks) if step else {}
    if dist.get_rank() == 0:
        torch.save({"loss": float(loss), "weights": exported}, os.path.join(out_dir, f"{tag}.export.pt"))
    if save_to:
        from mgrpo.checkpoint import Saver

        cfg.checkpoint.save_dir, cfg.model.path = save_to, model_dir
        Saver(cfg).save(actor, 1, {"step": 1, "weight_version": 1})
    dist.barrier()


def _set_entropy_masks(actor, mbs, q: float, per_rank: bool) -> None:
    from mgrpo.loss.entropy_mask import set_entropy_masks

    _, entropies = actor.logprobs(mbs, entropy=True)
    if entropies:  # last pipeline stage
        for mb, ent in zip(mbs, entropies):
            mb["entropy"] = ent
        set_entropy_masks(mbs, q, None if per_rank else mpu.get_data_parallel_group(with_context_parallel=True))


def load_layout(out_dir: str, tag: str) -> dict:
    """Merge one layout's files into {'loss', 'grads', 'weights'}."""
    path = os.path.join(out_dir, f"{tag}.export.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no results for layout {tag} in {out_dir}")
    merged = dict(torch.load(path, weights_only=True), grads={})
    for f in sorted(f for f in os.listdir(out_dir) if f.startswith(tag + ".pp")):
        merged["grads"].update(torch.load(os.path.join(out_dir, f), weights_only=True)["grads"])
    return merged


def run_export_roundtrip(cfg, model_dir: str, out_dir: str, tag: str, per_dp: bool = False) -> None:
    """HF -> megatron -> export_hf (64 KiB buckets, so many buckets and PP hand-offs) vs the HF files. `per_dp`:
    every data-parallel replica exports to its own first rank at once (one engine per DP group); each checks."""
    from mgrpo.models.builder import build_model
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.weights.export import rank_coords
    from mgrpo.weights.load import SafetensorsReader, load_hf

    setup_model_parallel(cfg.parallel, cfg.train.seed)
    chunks = build_model(model_dir, cfg.parallel)
    load_hf(chunks, model_dir)
    coords = rank_coords()
    dst = (
        {
            d: next(r for r in range(len(coords)) if coords[r, :4].tolist() == [0, 0, d, 0])
            for d in range(mpu.get_data_parallel_world_size())
        }
        if per_dp
        else 0
    )
    got = {}
    for name, t in export_hf(chunks, dst=dst, bucket_bytes=64 << 10):
        got[name] = t.clone()
    if dist.get_rank() in (dst.values() if per_dp else (0,)):
        reader = SafetensorsReader(model_dir)
        mismatched = [n for n in reader.where if n not in got or not torch.equal(got[n], reader.read(n))]
        extra = sorted(set(got) - set(reader.where))
        result = {
            "names": len(got),
            "mismatched": mismatched,
            "extra": extra,
            "embed_rows": list(got["model.embed_tokens.weight"].shape),
            "lm_head_rows": list(got["lm_head.weight"].shape) if "lm_head.weight" in got else None,
        }
        suffix = f".rank{dist.get_rank()}" if per_dp else ""
        with open(os.path.join(out_dir, f"{tag}{suffix}.roundtrip.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def run_init_export(cfg, model_dir: str, out_dir: str, tag: str, input_ids: torch.Tensor) -> None:
    """A megatron-initialised model (never loaded from HF): save its own logits and its HF export."""
    from mgrpo.actor import forward_backward
    from mgrpo.models.builder import build_model
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.weights.hf_writer import write_hf_folder

    setup_model_parallel(cfg.parallel, cfg.train.seed)
    chunks = build_model(model_dir, cfg.parallel, seed=4321)
    b, s = input_ids.shape
    mb = {
        "input_ids": input_ids,
        "position_ids": torch.arange(s)[None].expand(b, -1),
        "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None],
    }
    stats = forward_backward(
        chunks, [mb], lambda m, logits: (logits.sum() * 0, {"logits": logits.detach()}), forward_only=True
    )
    if stats:
        shard = stats[0]["logits"].contiguous()
        group = mpu.get_tensor_model_parallel_group()
        parts = [torch.empty_like(shard) for _ in range(mpu.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, shard, group=group)
        if _owner():
            vocab = chunks[0].mgrpo_info.vocab_size
            torch.save(torch.cat(parts, -1)[..., :vocab], os.path.join(out_dir, f"{tag}.logits.pt"))
    stream = export_hf(chunks, dst=0, bucket_bytes=256 << 10)
    if dist.get_rank() == 0:
        write_hf_folder(stream, os.path.join(out_dir, f"{tag}.hf"), model_dir, overwrite=True)
    else:
        for _ in stream:
            pass
    dist.barrier()


def _state_snapshot(actor) -> dict:
    """Every local parameter and every tensor or number of the optimizer's state, copied."""
    out = {f"param:{i}:{n}": p.detach().clone() for i, c in enumerate(actor.chunks) for n, p in c.named_parameters()}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj.detach().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for k, v in enumerate(obj):
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (int, float)):
            out[prefix] = torch.tensor(obj, dtype=torch.float64)

    walk("optimizer", actor.optimizer.state_dict())
    for j, group in enumerate(actor.optimizer.param_groups):
        out[f"lr/{j}"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    return out


def run_nan_step(cfg, model_dir: str, samples: list, out_dir: str, tag: str, guard: bool = True) -> None:
    """A normal step, then a step where one micro-batch's loss is NaN, then a normal step again.

    Saves per rank: whether the NaN step left parameters, optimizer state (Adam's moments, step count) and
    learning rates bitwise unchanged, and whether the next step moved the weights and kept them finite.
    `guard=False` turns the non-finite check off (the negative control: megatron's optimizer steps anyway).
    """
    from mgrpo.actor import Actor
    from mgrpo.parallel.state import setup_model_parallel

    setup_model_parallel(cfg.parallel, cfg.train.seed)
    actor = Actor(cfg, model_dir)
    if not guard:
        actor.grads_finite = lambda: True
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    idx = dp_shard(list(range(len(samples))), dp_rank, dp_size)
    weights = token_weights(samples, aggregation_of(cfg.algorithm), cfg.rollout.max_tokens)

    def batch(poison: bool):
        mbs = make_microbatches(
            [samples[i] for i in idx],
            cfg.train.micro_batch_size,
            0,
            [samples[i].info["advantage"] for i in idx],
            1,
            same_length=cfg.parallel.pp > 1,
            token_weights=[weights[i] for i in idx],
        )
        for mb in mbs:
            mb["old_logp"] = mb["rollout_logp"]
        if poison:
            mbs[1]["advantages"][mbs[1]["loss_mask"] > 0] = float("nan")
        return mbs

    first = actor.train_step(batch(False))
    before = _state_snapshot(actor)
    bad = actor.train_step(batch(True))
    after = _state_snapshot(actor)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    nxt = actor.train_step(batch(False))
    final = _state_snapshot(actor)
    params = [k for k in final if k.startswith("param:")]
    result = {
        "rank": dist.get_rank(),
        "first_ok": first["update_ok"],
        "bad_ok": bad["update_ok"],
        "bad_grad_norm": str(bad["grad_norm"]),
        "skipped": bad["skipped_steps"],
        "changed": changed[:10],
        "n_changed": len(changed),
        "n_state": len(before),
        "n_optimizer_tensors": sum(1 for k in before if k.startswith("optimizer")),
        "next_ok": nxt["update_ok"],
        "next_finite": all(bool(torch.isfinite(final[k]).all()) for k in params),
        "next_moved": any(not torch.equal(final[k], after[k]) for k in params),
        "next_grad_norm": nxt["grad_norm"],
    }
    with open(os.path.join(out_dir, f"{tag}.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
