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
    from mgrpo.data.packing import model_inputs, packed_attention
    from mgrpo.models.router_stats import tokens_of
    from mgrpo.models.routing import routes_of

    def step(data_iterator, model):
        mb = next(data_iterator)
        packed = mb.get("packed") or {}
        valid, routing = (
            (packed["valid"][None], packed.get("routing")) if packed else (mb.get("valid"), mb.get("routing"))
        )
        with (
            tokens_of(valid),
            routes_of(None if routing is None else routing[None] if packed else routing),
            packed_attention(unwrap(model), packed),
        ):  # MoE: padding out of metrics; replay; packed rows
            out = model(*model_inputs(mb))
        return out, functools.partial(loss_fn, mb)

    vpp = len(model_chunks) > 1
    data = [iter(microbatches) for _ in model_chunks] if vpp else iter(microbatches)
    shapes = [model_inputs(mb)[0].shape for mb in microbatches]
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
