"""Router metrics of a mixture-of-experts policy: tokens per expert and the load-balancing loss, per layer.

A forward hook on every megatron router reads its input (the tokens' hidden states) and its routing map during
the training forward of each micro-batch; padding is left out through the micro-batch's `valid` mask, which the
pipeline step publishes (`tokens_of`) just before it runs the chunk. At the end of an optimizer step the per-layer
sums are added over all ranks (each rank's tokens are its own: DP, CP and sequence-parallel TP ranks hold disjoint
tokens, MoE needs SP with TP, and a PP rank fills only its layers), so every rank logs the same numbers.

`moe/aux_loss` is the Switch/GShard load-balancing loss as HF's `load_balancing_loss_func` computes it, divided by
top-k so that perfect balance reads 1.0 (megatron's `moe_aux_loss_coeff` scales the same quantity): it is
reported whether or not `model.moe.aux_loss_coeff` puts it in the loss.
"""

from __future__ import annotations

import contextlib
import math

import torch

from mgrpo.models.routing import StepSums, moe_routers, router_order

_VALID = None  # [batch, seq] bool of the micro-batch being run, or None (every token counts)


@contextlib.contextmanager
def tokens_of(valid):
    """Publish the micro-batch's real-token mask while its chunk runs (set by the pipeline's forward step)."""
    global _VALID
    prev, _VALID = _VALID, valid
    try:
        yield
    finally:
        _VALID = prev


class RouterStats(StepSums):
    """Hooks on every router of `chunks`; `collect()` turns on counting, `reduce()` returns the step's metrics."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int, topk: int, sequence_parallel: bool):
        super().__init__(num_layers, 2 * num_experts + 1)
        self.num_experts, self.topk, self.sp = num_experts, topk, sequence_parallel
        for g, router in moe_routers(chunks):
            router.register_forward_hook(self._hook(g))

    def _valid_tokens(self):
        if _VALID is None:
            return None
        return router_order(_VALID, self.sp).to(torch.bool)  # megatron's token order, this TP rank's chunk

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not self.active:
                return
            with torch.no_grad():
                hidden = args[0].reshape(-1, args[0].shape[-1])
                routing_map = output[1].reshape(hidden.shape[0], -1)
                scores = torch.softmax(hidden.float() @ module.weight.float().t(), dim=-1)
                valid = self._valid_tokens()
                if valid is not None:
                    scores, routing_map = scores[valid.to(scores.device)], routing_map[valid.to(scores.device)]
                row = self.sums[layer]
                row[: self.num_experts] += routing_map.sum(0).double().cpu()
                row[self.num_experts : 2 * self.num_experts] += scores.sum(0).double().cpu()
                row[-1] += scores.shape[0]

        return hook

    def reduce(self, group=None) -> dict:
        """The step's metrics (a collective over `group`, default the world); the sums start again from zero."""
        return router_metrics(self.take(group), self.num_experts, self.topk)


def router_metrics(sums: torch.Tensor, num_experts: int, topk: int) -> dict:
    """[layers, 2E + 1] rows of (tokens routed to each expert, summed router probability of each expert, tokens)
    -> moe/ metrics; layers that saw no token (dense ones) are left out."""
    out, cvs, aux, peak = {}, [], [], []
    for layer, row in enumerate(sums):
        tokens = float(row[-1])
        if tokens == 0:
            continue
        counts, probs = row[:num_experts], row[num_experts : 2 * num_experts]
        mean = float(counts.mean())
        cv = float(counts.std(unbiased=False)) / mean if mean else 0.0
        loss = num_experts * float((counts / tokens * probs / tokens).sum()) / topk
        out.update(
            {
                f"moe/layer_{layer:02d}/tokens_per_expert_min": float(counts.min()),
                f"moe/layer_{layer:02d}/tokens_per_expert_max": float(counts.max()),
                f"moe/layer_{layer:02d}/tokens_per_expert_cv": cv,
                f"moe/layer_{layer:02d}/aux_loss": loss,
            }
        )
        cvs.append(cv)
        aux.append(loss)
        peak.append(float(counts.max()) / mean if mean else 0.0)
    if cvs:
        out.update(
            {
                "moe/tokens_per_expert_cv": sum(cvs) / len(cvs),
                "moe/aux_loss": sum(aux) / len(aux),
                "moe/max_load_over_mean": max(peak),
            }
        )
    return {k: (v if math.isfinite(v) else 0.0) for k, v in out.items()}
