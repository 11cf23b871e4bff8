"""A thin wrapper over megatron's forward/backward schedules (no pipelining, 1F1B, interleaved VPP)."""
from __future__ import annotations

import functools

from megatron.core.pipeline_parallel import get_forward_backward_func


def unwrap(chunk):
    """GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def forward_backward(model_chunks: list, microbatches: list, loss_fn, forward_only: bool) -> list:
    """Run `loss_fn(mb, output_tensor) -> (loss, stats)` over every micro-batch through the pipeline.

    Returns the per-micro-batch stats on the last pipeline stage ([] elsewhere). Sequence lengths may
    differ between micro-batches (config.variable_seq_lengths makes the p2p layer send shapes).
    """
    from mgrpo.models.router_stats import tokens_of
    from mgrpo.models.routing import routes_of

    def step(data_iterator, model):
        mb = next(data_iterator)
        with tokens_of(mb.get("valid")), routes_of(mb.get("routing")):  # MoE: padding out of metrics; replay
            out = model(mb["input_ids"], mb["position_ids"], mb["attention_mask"])
        return out, functools.partial(loss_fn, mb)

    vpp = len(model_chunks) > 1
    data = [iter(microbatches) for _ in model_chunks] if vpp else iter(microbatches)
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=data, model=model_chunks if vpp else model_chunks[0],
        num_microbatches=len(microbatches),
        # megatron divides seq_length by cp to size p2p buffers: give it the full (pre-split) length
        seq_length=max(mb["input_ids"].shape[1] * mb.get("cp_size", 1) for mb in microbatches),
        micro_batch_size=max(mb["input_ids"].shape[0] for mb in microbatches), forward_only=forward_only)
