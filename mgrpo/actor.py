"""The trained policy: megatron chunks + DDP + optimizer, with logprob and train passes over micro-batches.

Loss scaling: each micro-batch carries per-token aggregation weights from global counts
(`mgrpo.loss.aggregation`). Megatron divides a 2-tuple loss by num_microbatches (times cp) and DDP averages
gradients over DP x CP, so each micro-batch returns sum(weight x per-token loss) x num_microbatches x dp:
the summed gradient is the single-device gradient of the whole batch's loss.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as mpu

from mgrpo.loss.logprobs import vocab_parallel_logprobs
from mgrpo.loss.registry import policy_loss
from mgrpo.loss.rollout_correction import rollout_is_weights_from_cfg, rollout_offpolicy_metrics
from mgrpo.models.builder import build_model, have_transformer_engine
from mgrpo.parallel.device import on_cuda
from mgrpo.parallel.pipeline import unwrap
from mgrpo.parallel.state import gloo_groups_created
from mgrpo.weights.load import load_hf


class Actor:
    def __init__(self, cfg, model_dir: str, train: bool = True, replay_routing: bool | None = None):
        """`replay_routing`: MoE routing replay for this model's forwards (None: algorithm.routing_replay); the
        reference policy routes on its own (`reference_policy`)."""
        self.cfg = cfg
        from mgrpo.models.fast_paths import attention_choice

        lora = cfg.model.lora.rank > 0 and train  # LoRA's own local spec (TE fuses the norm into linear_qkv)
        packing = cfg.train.sequence_packing
        choice = attention_choice(lora, packing, cfg.parallel.cp, have_transformer_engine())
        self.thd = choice.thd  # packed rows as TE's THD sequences (forward_backward)
        chunks = build_model(
            model_dir,
            cfg.parallel,
            cfg.model.params_dtype,
            cfg.model.make_vocab_size_divisible_by,
            config_overrides=fast_path_overrides(cfg, choice.te_spec, train),
            seed=cfg.train.seed,
            moe=cfg.model.moe,
            use_te=choice.te_spec,
            packing=packing and not choice.thd,  # our core attention for packed rows
            fused_attention=choice.fused,
        )
        load_hf(chunks, model_dir)
        if lora:  # adapters on the frozen base (models/lora.py); DDP and the optimizer see the adapters only
            from mgrpo.models.lora import apply_lora

            apply_lora(chunks, cfg.model.lora, cfg.train.seed)
        self.info = chunks[0].mgrpo_info
        self.config = chunks[0].config
        self.chunks, self.optimizer, self.scheduler = chunks, None, None
        self.skipped_steps = 0  # optimizer steps skipped for non-finite gradients
        self.seq_sum = None  # per-sequence sums across CP ranks (None: plain row sums)
        if cfg.parallel.cp > 1:
            from mgrpo.parallel.context_parallel import cp_seq_sum

            self.seq_sum = cp_seq_sum(mpu.get_context_parallel_group())
        self.router_stats = self.routing = None  # MoE: tokens per expert, balancing loss; replay and agreement
        if self.info.moe is not None:
            from mgrpo.models.router_stats import RouterStats
            from mgrpo.models.routing import RoutingReplay

            m = self.info.moe
            self.router_stats = RouterStats(
                chunks, self.info.num_hidden_layers, m.num_experts, m.topk, bool(cfg.parallel.sp)
            )
            replay = cfg.algorithm.routing_replay if replay_routing is None else replay_routing
            self.routing = RoutingReplay(chunks, self.info, replay, bool(cfg.parallel.sp))
        if train:
            self._wrap_for_training()

    def _wrap_for_training(self):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from mgrpo.models.fast_paths import overlap_settings

        t = self.cfg.train
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.config.params_dtype != torch.float64,
            use_distributed_optimizer=t.use_distributed_optimizer,
            **overlap_settings(t, on_cuda()),
        )
        self.chunks = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(self.chunks)
        ]
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=0.9,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.grad_clip,
            bf16=self.cfg.model.params_dtype == "bfloat16",
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=t.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks, use_gloo_process_groups=gloo_groups_created())
        self.scheduler = make_lr_schedule(self.optimizer, t)

    def _logprobs(self, mb, logits, entropy: bool = False):
        """Per-token logprobs (and entropies) [B, L]; a packed row's are scattered back to the padded layout."""
        tp = mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None
        packed = mb.get("packed")
        targets = mb["targets"] if packed is None else packed["targets"][None]
        logp, ent = vocab_parallel_logprobs(
            logits,
            targets,
            tp,
            temperature=self.cfg.rollout.temperature,
            compute_entropy=entropy,
            vocab_size=self.info.vocab_size,
        )
        if packed is None:
            return logp, ent
        from mgrpo.data.packing import unpack

        return unpack(packed, logp), None if ent is None else unpack(packed, ent)

    @torch.no_grad()
    def logprobs(self, microbatches: list, entropy: bool = False):
        """Per-token logprobs [b, L] per micro-batch on the last pipeline stage ([] elsewhere); with `entropy`,
        (logprobs, entropies) from the same fused-kernel pass."""
        for c in self.chunks:
            c.eval()

        def loss_fn(mb, logits):
            logp, ent = self._logprobs(mb, logits, entropy=entropy)
            out = {"logp": logp * mb["loss_mask"]}
            if entropy:
                out["entropy"] = ent * mb["loss_mask"]
            return logits.sum() * 0.0, out

        stats = forward_backward(self.chunks, microbatches, loss_fn, forward_only=True, thd=self.thd)
        logps = [s["logp"] for s in stats]
        return (logps, [s["entropy"] for s in stats]) if entropy else logps

    def forward_backward(self, microbatches: list) -> list:
        """Gradients of the batch loss into the DDP grad buffers (`param.main_grad`); per-micro-batch stats."""
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        alg = self.cfg.algorithm
        scale = len(microbatches) * mpu.get_data_parallel_world_size()
        fn = policy_loss(alg.policy_loss)

        def loss_fn(mb, logits):
            mask = mb["loss_mask"]
            logp, entropy = self._logprobs(mb, logits, entropy=True)  # always logged (actor/entropy)
            old = mb.get("old_logp")  # None: one update per rollout, pi_old is this very policy
            old = logp.detach() if old is None else old
            is_weights, stats = None, {}
            if alg.rollout_is_mode:
                is_weights, is_metrics = rollout_is_weights_from_cfg(
                    old, mb["rollout_logp"], mask, alg, seq_sum=self.seq_sum, has_rollout=mb.get("has_rollout")
                )
                stats.update({f"rollout_is/{k}": v for k, v in is_metrics.items()})
            else:  # the engine/trainer mismatch is always worth seeing (e.g. top-p/top-k truncation)
                diag = rollout_offpolicy_metrics(old, mb["rollout_logp"], mask, has_rollout=mb.get("has_rollout"))
                stats.update({f"rollout_is/{k}": v for k, v in diag.items()})
            advantages, keep = mb["advantages"], mb.get("entropy_mask")
            if keep is not None:  # the top-entropy token mask: the others lose their policy term (loss/entropy_mask.py)
                advantages = advantages * keep
            per_token, metrics = fn(
                logp,
                old,
                advantages,
                mask,
                alg,
                ref_logp=mb.get("ref_logp"),
                rollout_is_weights=is_weights,
                seq_sum=self.seq_sum,
            )
            if alg.entropy_coef:
                per_token = per_token - alg.entropy_coef * entropy * mask
            metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp_min(1)
            if keep is not None:
                metrics["entropy_mask_frac"] = (keep * mask).sum() / mask.sum().clamp_min(1)
            weighted = (per_token * mb["token_weight"]).sum()
            tokens = mask.sum()
            stats = {k: v.detach() * tokens for k, v in {**stats, **metrics}.items()}
            stats.update(loss_sum=weighted.detach(), tokens=tokens)
            return weighted * scale, stats

        return forward_backward(self.chunks, microbatches, loss_fn, forward_only=False, thd=self.thd)

    def grads_finite(self) -> bool:
        """True on every rank iff every rank's gradients are finite (one all-reduce over the world).

        megatron-core 0.16's FP32 optimizer clips and steps even when the gradient norm is NaN, and its
        mixed-precision optimizer only checks with an fp16 loss scaler: a NaN would reach the weights."""
        import torch.distributed as dist

        from mgrpo.parallel.device import device as trainer_device

        total, device = torch.zeros((), dtype=torch.float64), trainer_device()
        for chunk in self.chunks:
            for p in chunk.parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    total = total.to(g.device) + g.sum(dtype=torch.float64)
                    device = g.device
        flag = torch.tensor([0.0 if torch.isfinite(total) else 1.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag) == 0.0

    def train_step(self, microbatches: list) -> dict:
        """One optimizer step over all micro-batches; returns metrics averaged over tokens (last stage);
        `loss` is this rank's share of the batch loss (sum over ranks = the batch loss).

        A step whose gradients are not finite on some rank is skipped on every rank: weights, Adam's moments
        and step count stay as they were (`update_ok` False, `skipped_steps` counts them)."""
        moe = self.router_stats is not None
        with (
            self.router_stats.collect() if moe else contextlib.nullcontext(),
            self.routing.collect() if moe else contextlib.nullcontext(),
        ):
            stats = self.forward_backward(microbatches)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the LR this optimizer step is scheduled to use
        if self.grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
        else:
            ok, grad_norm = False, float("nan")
            self.skipped_steps += 1
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
        if self.scheduler is not None:  # a skipped step keeps its place in the schedule (make_lr_schedule)
            self.scheduler.step(increment=1)
        out = {
            "grad_norm": float(grad_norm if grad_norm is not None else 0.0),
            "update_ok": bool(ok),
            "skipped_steps": self.skipped_steps,
            "lr": lr,
        }
        if moe:
            out.update(self.router_stats.reduce(), **self.routing.reduce())
        if stats:
            tokens = sum(float(s["tokens"]) for s in stats)
            for k in stats[0]:
                if k not in ("tokens", "loss_sum"):
                    out[k] = sum(float(s[k]) for s in stats) / max(tokens, 1)
            out["loss"] = sum(float(s["loss_sum"]) for s in stats)
            out["tokens"] = tokens
        return out

    def models(self) -> list:
        return [unwrap(c) for c in self.chunks]

    def current_params(self) -> list:
        """The modules with every parameter current, for the weight export and the HF export. With
        train.overlap_param_gather the optimizer step updates only this rank's shard, and megatron gathers the others
        in the next forward's pre-hooks; read now they would be one step stale, so gather them here (megatron-LM
        does the same before a checkpoint: `disable_forward_pre_hook(param_sync=True)`)."""
        for c in self.chunks:
            if getattr(c, "use_forward_hook", False):
                c.start_param_sync(force_sync=True)
        return self.models()

    def train_state(self) -> dict:
        """What a checkpoint needs beyond the tensors: the LR schedule's position and the skipped-step count."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "skipped_steps": self.skipped_steps,
        }

    def load_train_state(self, state: dict) -> None:
        """The schedule is rebuilt from this run's config (train.steps may have changed) at the saved position."""
        self.skipped_steps = state["skipped_steps"]
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.num_steps = 0
            self.scheduler.step(increment=state["scheduler"]["num_steps"])


class BasePolicy:
    """A LoRA actor with its adapters off: the KL reference at no memory cost (ms-swift's null_ref_context).
    It routes on its own, like the frozen reference (`reference_policy`)."""

    def __init__(self, actor: Actor):
        self.actor = actor

    def logprobs(self, microbatches: list, entropy: bool = False):
        from mgrpo.models.lora import adapters_disabled

        no_replay = self.actor.routing.replay_off() if self.actor.routing else contextlib.nullcontext()
        with adapters_disabled(self.actor.models()), no_replay:
            return self.actor.logprobs(microbatches, entropy=entropy)


def fast_path_overrides(cfg, te_linears: bool, train: bool) -> dict:
    """TransformerConfig fields for model.fusions and (a model that trains) train.recompute (models/fast_paths.py)."""
    from mgrpo.models.fast_paths import fusion_overrides, kernels, recompute_overrides

    te, cuda = have_transformer_engine(), on_cuda()
    out = fusion_overrides(cfg.model.fusions, cuda, te, te_linears, True, kernels())  # builder: MoE keys for MoE only
    return {**out, **(recompute_overrides(cfg.train.recompute) if train else {})}


def reference_policy(cfg, actor: Actor):
    """The KL reference: None without a KL term; the base (adapters off) for LoRA; else a frozen copy.

    MoE: the reference routes each token by its own router, never by the rollout engine's record. Routing replay
    (R3) removes the engine/trainer mismatch of the policy being trained; the KL term measures the distance to the
    reference model as that model computes it. verl's `compute_ref_log_prob` (verl/workers/megatron_workers.py)
    sets no replay action and its ref config has `router_replay.mode: disabled`; slime's `train_actor`
    (slime/backends/megatron_utils/actor.py) runs the reference with ROUTING_REPLAY_STAGE="fallthrough". (verl's
    LoRA reference, the actor with its adapter off, does replay; ours does not, so both kinds of reference agree.)"""
    if cfg.algorithm.kl_coef <= 0:
        return None
    if cfg.model.lora.rank > 0:
        return BasePolicy(actor)
    return Actor(cfg, cfg.model.path, train=False, replay_routing=False)


def optimizer_steps(t, rollout_steps: int) -> int:
    return rollout_steps * t.steps_per_generation * t.num_iterations


def make_lr_schedule(optimizer, t, total_steps: int | None = None):
    """megatron's OptimizerParamScheduler over every optimizer step of the run, stepped once per optimizer step.

    Optimizer step k (1-based) of a warmup over W steps trains at lr * k / W (so the W-th reaches lr), then the
    schedule is constant or decays (linear, cosine) to `min_lr` at the run's last step. Two choices differ from
    Megatron-LM's own loop, on purpose:
    - megatron's get_lr at num_steps 0 is `init_lr` (`--lr-warmup-init`, default 0) and `train_step` advances
      the schedule after the update (megatron/core/optimizer_param_scheduler.py `get_lr`, __init__'s `step(0)`;
      megatron/training/training.py `train_step`), so its first warmup step trains at LR 0, "one step behind"
      (Megatron-Bridge issue #5399). An RL step costs a whole rollout: we use megatron's schedule with
      `init_lr = lr / W` and `lr_warmup_steps = W - 1`, which puts step k of the warmup at lr * k / W.
    - Megatron-LM (and slime's `train_one_step`) advance the schedule only `if update_successful`; we advance it
      for a step skipped for a non-finite gradient too, so the LR stays a function of the run's step count: a
      run with a skipped step still ends at `min_lr` on its last step, as planned."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = total_steps or optimizer_steps(t, t.steps)
    warm = t.warmup_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=t.lr / warm if warm else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr if t.lr_schedule != "constant" else t.lr,
        lr_warmup_steps=max(warm - 1, 0),
        lr_decay_steps=max(total - 1, warm, 1),
        lr_decay_style=t.lr_schedule,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=max(total, 1),
        wd_incr_style="constant",
    )


def forward_backward(model_chunks: list, microbatches: list, loss_fn, forward_only: bool, thd: bool = False) -> list:
    """Run `loss_fn(mb, output_tensor) -> (loss, stats)` over every micro-batch through megatron's schedules (no
    pipelining, 1F1B, interleaved VPP).

    Returns the per-micro-batch stats on the last pipeline stage ([] elsewhere). Sequence lengths may
    differ between micro-batches (config.variable_seq_lengths makes the p2p layer send shapes). `thd`: a packed row
    runs as TE's THD sequences (megatron applies each sample's RoPE from cu_seqlens), else through our core
    attention and RoPE table (data/packing.packed_attention).
    """
    import functools

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mgrpo.data import packing
    from mgrpo.models.router_stats import tokens_of
    from mgrpo.models.routing import routes_of

    def step(data_iterator, model):
        mb = next(data_iterator)
        packed = mb.get("packed") or {}
        valid, routing = (
            (packed["valid"][None], packed.get("routing")) if packed else (mb.get("valid"), mb.get("routing"))
        )
        thd_row = bool(packed) and thd
        with (
            tokens_of(valid),
            routes_of(None if routing is None else routing[None] if packed else routing),
            packing.packed_attention(unwrap(model), {} if thd_row else packed),
        ):  # MoE: padding out of metrics; replay; packed rows
            extra = dict(packed_seq_params=packing.thd_params(packed["segments"])) if thd_row else {}
            out = model(*packing.model_inputs(mb), **extra)
        return out, functools.partial(loss_fn, mb)

    vpp = len(model_chunks) > 1
    data = [iter(microbatches) for _ in model_chunks] if vpp else iter(microbatches)
    shapes = [packing.model_inputs(mb)[0].shape for mb in microbatches]
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=data,
        model=model_chunks if vpp else model_chunks[0],
        num_microbatches=len(microbatches),
        # megatron divides seq_length by cp to size p2p buffers: give it the full (pre-split) length
        seq_length=max(s[1] * mb.get("cp_size", 1) for s, mb in zip(shapes, microbatches)),
        micro_batch_size=max(s[0] for s in shapes),
        forward_only=forward_only,
    )
