"""Aggregation as per-token weights computed from global counts before the forward pass.

The loss of the whole step is sum over every token of weight * per_token_loss. Weights come from counts over
the global batch (all DP and CP ranks and micro-batches), so the gradient equals the single-device gradient
of the whole batch however it is split; `mgrpo.actor` cancels megatron's own scaling (1 / num_microbatches,
DDP's average over DP x CP). Definitions match `mgrpo.loss.presets.aggregate_reference`:

- token-mean: 1 / (loss tokens in the global batch)
- seq-mean-token-mean: 1 / (sequences in the batch x loss tokens of this sequence); every sequence counts in
  the mean, one with an empty mask contributes 0 (ms-swift's `.mean()` over rows)
- seq-mean-token-sum (verl): 1 / (sequences in the batch)
- seq-mean-token-sum-norm (Dr. GRPO): 1 / (sequences x max_len), max_len = rollout.max_tokens, a constant
"""

from __future__ import annotations

from mgrpo.loss.presets import AGGREGATIONS


def token_weights(samples: list, aggregation: str, max_len: int | None = None, include=None) -> list:
    """Per sample, a list of weights aligned with `response_ids` (0 where loss_mask is 0).

    `include` (bools, one per sample) leaves samples out of the batch entirely: weight 0 and not counted in
    the number of sequences (samples whose reward failed are not part of the loss at all).
    """
    include = [True] * len(samples) if include is None else list(include)
    kept = [s for s, ok in zip(samples, include) if ok]
    n_seq = max(len(kept), 1)
    if aggregation == "token-mean":
        total = sum(sum(s.loss_mask) for s in kept)
        per = [1.0 / max(total, 1)] * len(samples)
    elif aggregation == "seq-mean-token-mean":
        per = [1.0 / (n_seq * max(sum(s.loss_mask), 1)) for s in samples]
    elif aggregation == "seq-mean-token-sum":
        per = [1.0 / n_seq] * len(samples)
    elif aggregation == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (rollout.max_tokens)")
        per = [1.0 / (n_seq * max_len)] * len(samples)
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return [[w * m * ok for m in s.loss_mask] for w, s, ok in zip(per, samples, include)]


def per_microbatch_mean_weights(samples: list, micro_batch_size: int) -> list:
    """ms-swift's behaviour (token mean within each micro-batch, then the mean over micro-batches): the
    negative control of the exactness tests; it depends on how the batch is split."""
    out = []
    n_mb = -(-len(samples) // micro_batch_size)
    for start in range(0, len(samples), micro_batch_size):
        group = samples[start : start + micro_batch_size]
        tokens = max(sum(sum(s.loss_mask) for s in group), 1)
        out += [[m / tokens / n_mb for m in s.loss_mask] for s in group]
    return out
