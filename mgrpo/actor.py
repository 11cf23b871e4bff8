"""The trained policy: megatron chunks + DDP + optimizer, with logprob and train passes over micro-batches.

Loss scaling: megatron divides a 2-tuple loss by num_microbatches (times cp) and DDP averages gradients
over DP x CP. Each micro-batch returns sum(per-token loss) / global_tokens x num_microbatches x dp, so the
summed gradient equals the single-device gradient of the global token-mean.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from mgrpo.loss.logprobs import vocab_parallel_logprobs
from mgrpo.loss.registry import policy_loss
from mgrpo.models.builder import build_model
from mgrpo.parallel.pipeline import forward_backward, unwrap
from mgrpo.resharding.load import load_hf


class Actor:
    def __init__(self, cfg, model_dir: str, train: bool = True):
        self.cfg = cfg
        chunks = build_model(model_dir, cfg.parallel, cfg.model.params_dtype, cfg.model.make_vocab_size_divisible_by,
                             seed=cfg.train.seed)
        load_hf(chunks, model_dir)
        self.info = chunks[0].mgrpo_info
        self.config = chunks[0].config
        self.chunks, self.optimizer = chunks, None
        if train:
            self._wrap_for_training()

    def _wrap_for_training(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.cfg.train
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=t.use_distributed_optimizer)
        self.chunks = [DistributedDataParallel(config=self.config, ddp_config=ddp_cfg, module=c,
                                               disable_bucketing=i > 0) for i, c in enumerate(self.chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        opt_cfg = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                                  adam_beta1=0.9, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.grad_clip,
                                  bf16=self.cfg.model.params_dtype == "bfloat16",
                                  params_dtype=self.config.params_dtype,
                                  use_distributed_optimizer=t.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks)

    def _logprobs(self, mb, logits):
        tp = mpu.get_tensor_model_parallel_group() if mpu.get_tensor_model_parallel_world_size() > 1 else None
        logp, _ = vocab_parallel_logprobs(logits, mb["targets"], tp, temperature=self.cfg.rollout.temperature,
                                          vocab_size=self.info.vocab_size)
        return logp

    @torch.no_grad()
    def logprobs(self, microbatches: list) -> list:
        """Per-token logprobs [b, L] per micro-batch on the last pipeline stage; [] elsewhere."""
        for c in self.chunks:
            c.eval()

        def loss_fn(mb, logits):
            logp = self._logprobs(mb, logits)
            return logits.sum() * 0.0, {"logp": logp * mb["loss_mask"]}

        stats = forward_backward(self.chunks, microbatches, loss_fn, forward_only=True)
        return [s["logp"] for s in stats]

    def forward_backward(self, microbatches: list, global_tokens: int) -> list:
        """Gradients of the global token-mean loss into the DDP grad buffers (`param.main_grad`)."""
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        alg = self.cfg.algorithm
        scale = len(microbatches) * mpu.get_data_parallel_world_size() / max(global_tokens, 1)
        fn = policy_loss(alg.policy_loss)

        def loss_fn(mb, logits):
            logp = self._logprobs(mb, logits)
            per_token, m = fn(logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], alg)
            tokens = mb["loss_mask"].sum()
            stats = {k: v.detach() * tokens for k, v in m.items()}
            stats.update(loss_sum=per_token.detach().sum(), tokens=tokens)
            return per_token.sum() * scale, stats

        return forward_backward(self.chunks, microbatches, loss_fn, forward_only=False)

    def train_step(self, microbatches: list, global_tokens: int) -> dict:
        """One optimizer step over all micro-batches; returns metrics averaged over tokens (last stage)."""
        stats = self.forward_backward(microbatches, global_tokens)
        ok, grad_norm, _ = self.optimizer.step()
        out = {"grad_norm": float(grad_norm or 0.0), "update_ok": bool(ok)}
        if stats:
            tokens = sum(float(s["tokens"]) for s in stats)
            for k in stats[0]:
                if k != "tokens":
                    out["loss" if k == "loss_sum" else k] = sum(float(s[k]) for s in stats) / max(tokens, 1)
            out["tokens"] = tokens
        return out

    def models(self) -> list:
        return [unwrap(c) for c in self.chunks]
