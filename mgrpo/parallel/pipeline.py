"""The model chunk inside megatron's wrappers. The forward/backward step over the pipeline schedules lives with
the actor (mgrpo/actor.py `forward_backward`): it knows packing, routing replay and MoE metrics."""

from __future__ import annotations


def unwrap(chunk):
    """GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
