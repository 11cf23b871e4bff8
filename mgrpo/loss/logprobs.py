"""Fused, chunked, vocab-parallel token log-probabilities and entropy.

``vocab_parallel_logprobs(logits_shard, targets, tp_group, ...)`` computes, for every
token position, ``log softmax(logits / T)[target]`` and (optionally) the entropy
``H = -sum_j p_j log p_j`` of ``p = softmax(logits / T)`` when the vocabulary dimension
is split across the ranks of a tensor-parallel group (Megatron's vocab-parallel output
layer: rank ``r`` holds columns ``[r * V_local, (r + 1) * V_local)``).

Design
------
* The full vocabulary is never gathered. Each rank computes, per token, statistics of
  its shard (local max, sum of exponentials, sum of ``exp * z``, target logit); these
  are combined with exactly two all-reduces over the TP group for the whole call
  (one MAX for the max, one SUM of a ``[tokens, 3]`` tensor), independent of the chunk
  count.
* Tokens are processed in chunks of ``chunk_size`` rows; only one chunk is ever
  materialised as ``[chunk, V_local]`` fp32 temporaries (two of them at most), so the
  peak extra memory is ``~2 * chunk * V_local * 4`` bytes plus ``O(tokens)``. The default
  chunk keeps each temporary at ~16 MiB (see ``default_chunk_size``).
* A custom ``torch.autograd.Function`` saves only a reference to the input (no copy)
  and per-token statistics (global max ``m``, ``log S`` where ``S = sum exp(z - m)``,
  and the entropy ``H``), and recomputes the softmax chunk by chunk in backward.
  Backward needs no communication: with ``z = logits / T`` and ``p = softmax(z)``

      d logp_t / d z_j = 1[j == t] - p_j
      d H      / d z_j = -p_j * (log p_j + H)

  and ``d z / d logits = 1 / T``; ``p_j`` and ``log p_j`` only need the global per-token
  ``m`` and ``log S`` saved by forward.
* The input is never modified in place (Megatron's ``vocab_parallel_cross_entropy``
  subtracts the max in place, which corrupts logits that are reused).

Semantics
---------
* Computation is in fp32 for fp32/bf16/fp16 input, one chunk cast at a time; outputs are
  float32. (float64 input is computed and returned in float64, which allows
  ``torch.autograd.gradcheck``.) The gradient is returned in the input's dtype.
* Columns whose global index is ``>= vocab_size`` (Megatron pads the vocabulary to a
  multiple of the TP size) are treated as ``-inf``: excluded from the max, the sum and
  the entropy, and they receive exactly zero gradient. ``vocab_size=None`` means every
  column is real.
* Positions whose target equals ``ignore_index`` get logprob exactly 0 and entropy
  exactly 0, and their gradient rows are exactly zero.
* A target outside ``[0, vocab_size)`` that is not ``ignore_index`` raises ``ValueError``
  (checked with one device sync). All ranks of the group must pass identical targets.
* Logits must be finite (as produced by a linear layer); ``-inf`` logits are not
  supported (they would give NaN in the entropy terms).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs", "default_chunk_size", "DEFAULT_CHUNK_ELEMENTS"]

#: ``chunk_size=None`` picks ``max(1, DEFAULT_CHUNK_ELEMENTS // V_local)`` tokens per chunk,
#: i.e. fp32 temporaries of ~16 MiB each (27 tokens at V_local = 152064, 55 at 76032).
#: Chunks that fit in the last-level cache are also the fastest on CPU: at V_local=152064
#: chunks of 8-32 tokens ran fwd+bwd ~2x faster than chunks of 512-1024 tokens.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


#: On a GPU the size that suits a CPU cache (27 tokens a chunk) means thousands of kernel launches per micro-batch;
#: there a chunk's fp32 temporary takes up to 1/16 of the free device memory, at most 1 GiB (two are alive at once).
GPU_CHUNK_FREE_FRACTION, GPU_CHUNK_MAX_BYTES = 16, 1 << 30


def default_chunk_size(v_local: int, device: Optional[torch.device] = None, free_bytes: Optional[int] = None) -> int:
    """Tokens per chunk used when ``chunk_size is None``: cache-sized on CPU; on CUDA from the device's free
    memory (``torch.cuda.mem_get_info``, or ``free_bytes`` when given)."""
    v_local = max(1, v_local)
    if device is not None and device.type == "cuda":
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(device)[0]
        budget = min(free_bytes // GPU_CHUNK_FREE_FRACTION, GPU_CHUNK_MAX_BYTES)
        return max(1, budget // (4 * v_local))
    return max(1, DEFAULT_CHUNK_ELEMENTS // v_local)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tempered_copy(x: torch.Tensor, temperature: float, cdtype: torch.dtype) -> torch.Tensor:
    """A fresh ``cdtype`` tensor holding ``x / temperature`` (never aliases ``x``)."""
    if x.dtype == cdtype:
        return torch.div(x, temperature) if temperature != 1.0 else x.clone()
    z = x.to(cdtype)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, targets, group, rank, world, temperature, compute_entropy, chunk, ignore_index, vocab_size):
        # x: [N, V_local] (any float dtype), targets: [N] long.
        n_tok, v_local = x.shape
        cdtype = _compute_dtype(x.dtype)
        dev = x.device
        start = rank * v_local
        n_valid = max(0, min(v_local, vocab_size - start))  # real (non-padding) local columns

        local_idx = targets - start
        row_ok = targets != ignore_index
        on_rank = row_ok & (local_idx >= 0) & (local_idx < n_valid)
        gather_idx = local_idx.clamp(0, max(n_valid - 1, 0)).unsqueeze(1)

        m_loc = torch.full((n_tok,), float("-inf"), dtype=cdtype, device=dev)
        # stats[:, 0] = sum exp(z - m_loc), [:, 1] = sum exp(z - m_loc) * (z - m_loc),
        # [:, 2] = target logit z_t (absolute; exact same rounding as z).
        stats = torch.zeros((n_tok, 3), dtype=cdtype, device=dev)

        if n_valid > 0:
            for s in range(0, n_tok, chunk):
                e_ = min(s + chunk, n_tok)
                xc = x[s:e_, :n_valid]
                if temperature == 1.0:  # fast path: one pass makes the shifted fp32 copy
                    zt = xc.gather(1, gather_idx[s:e_]).squeeze(1).to(cdtype)
                    mc = xc.amax(dim=1).to(cdtype)
                    z = torch.sub(xc, mc.unsqueeze(1))  # promotes to cdtype; new tensor
                else:
                    z = _tempered_copy(xc, temperature, cdtype)  # [c, n_valid]
                    zt = z.gather(1, gather_idx[s:e_]).squeeze(1)
                    mc = z.amax(dim=1)
                    z.sub_(mc.unsqueeze(1))
                stats[s:e_, 2] = torch.where(on_rank[s:e_], zt, torch.zeros_like(zt))
                m_loc[s:e_] = mc
                if compute_entropy:
                    ez = torch.exp(z)
                    stats[s:e_, 0] = ez.sum(dim=1)
                    stats[s:e_, 1] = ez.mul_(z).sum(dim=1)  # (bmm is far slower on CPU)
                    del ez
                else:
                    stats[s:e_, 0] = z.exp_().sum(dim=1)
                del z

        # Combine shards: global max, then rescale local sums to it and SUM-reduce.
        m = m_loc.clone()
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        has = stats[:, 0] > 0  # False only on a rank with no real columns
        delta = torch.where(has, m_loc - m, torch.zeros_like(m))  # <= 0
        scale = torch.where(has, torch.exp(delta), torch.zeros_like(m))
        s_loc = stats[:, 0].clone()
        stats[:, 0] = s_loc * scale
        if compute_entropy:
            # sum exp(z - m)(z - m) = e^{delta} * (A_loc + delta * S_loc)
            stats[:, 1] = scale * (stats[:, 1] + delta * s_loc)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

        sum_exp = stats[:, 0]
        log_s = torch.log(sum_exp)
        zero = torch.zeros_like(m)
        logp = torch.where(row_ok, (stats[:, 2] - m) - log_s, zero).clamp_(max=0.0)  # rounding guard
        ent = None
        if compute_entropy:
            ent = torch.where(row_ok, log_s - stats[:, 1] / sum_exp, zero).clamp_(min=0.0)

        ctx.set_materialize_grads(False)
        # (ent is cloned so callers may modify the returned entropy in place)
        ctx.save_for_backward(x, targets, m, log_s, ent.clone() if compute_entropy else None)
        ctx.cfg = (rank, temperature, chunk, ignore_index, vocab_size, n_valid)
        if compute_entropy:
            return logp, ent
        return logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        x, targets, m, log_s, ent = ctx.saved_tensors
        rank, temperature, chunk, ignore_index, vocab_size, n_valid = ctx.cfg
        if g_logp is None and g_ent is None:
            return (None,) * 10
        n_tok, v_local = x.shape
        cdtype = _compute_dtype(x.dtype)
        start = rank * v_local
        row_ok = targets != ignore_index
        zero = torch.zeros_like(m)
        inv_t = 1.0 / temperature
        # Fold the masking of ignored rows and the 1/T of dz/dlogits into the per-token
        # upstream gradients.
        glp = torch.where(row_ok, g_logp.to(cdtype), zero) * inv_t if g_logp is not None else None
        gh = torch.where(row_ok, g_ent.to(cdtype), zero) * inv_t if g_ent is not None else None
        if gh is not None:
            # grad_z = -p * (gh * (logp_j + H) + glp) + glp * onehot
            #        = p * (logp_j * (-gh) + c) + glp * onehot, c = -(gh * H + glp)
            neg_gh = -gh
            c = -(gh * ent + (glp if glp is not None else 0.0))
        local_idx = targets - start
        on_rank = row_ok & (local_idx >= 0) & (local_idx < n_valid)
        if glp is not None:
            scatter_val = torch.where(on_rank, glp, zero).unsqueeze(1)
            scatter_idx = local_idx.clamp(0, max(n_valid - 1, 0)).unsqueeze(1)

        grad = torch.empty_like(x, memory_format=torch.contiguous_format)
        if n_valid < v_local:
            grad[:, n_valid:].zero_()
        if n_valid > 0:
            for s in range(0, n_tok, chunk):
                e_ = min(s + chunk, n_tok)
                xc = x[s:e_, :n_valid]
                if temperature == 1.0:
                    lp = torch.sub(xc, m[s:e_].unsqueeze(1))  # promotes to cdtype; new tensor
                else:
                    lp = _tempered_copy(xc, temperature, cdtype).sub_(m[s:e_].unsqueeze(1))
                lp.sub_(log_s[s:e_].unsqueeze(1))  # log p_j (m, log S kept apart for precision)
                if gh is not None:
                    p = torch.exp(lp)
                    tmp = lp.mul_(neg_gh[s:e_].unsqueeze(1)).add_(c[s:e_].unsqueeze(1)).mul_(p)
                    del p
                else:
                    tmp = lp.exp_().mul_(-glp[s:e_].unsqueeze(1))
                if glp is not None:
                    tmp.scatter_add_(1, scatter_idx[s:e_], scatter_val[s:e_])
                grad[s:e_, :n_valid].copy_(tmp)
                del tmp, lp
        return grad, None, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    tp_group=None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: Optional[int] = None,
    ignore_index: int = -100,
    vocab_size: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log softmax(logits / temperature)[target]`` (and entropy) over a
    vocabulary split across ``tp_group``.

    Args:
        logits_shard: ``[..., V_local]`` logits of this rank's contiguous vocabulary slice
            (rank ``r`` holds global columns ``[r * V_local, (r + 1) * V_local)``).
        targets: ``[...]`` integer global token ids (same leading shape, same on all ranks).
        tp_group: ``torch.distributed`` process group of the vocab split; ``None`` = no TP.
        temperature: logits are divided by it (as in rollout sampling); must be > 0.
        compute_entropy: also return the per-token entropy of ``softmax(logits / T)``.
        chunk_size: tokens per chunk; ``None`` = ``default_chunk_size(V_local)``, i.e.
            ~4M elements (16 MiB fp32) per ``[chunk, V_local]`` temporary.
        ignore_index: target value whose positions get logprob = entropy = 0 and zero grad.
        vocab_size: real vocabulary size; columns with global index ``>= vocab_size``
            (padding) are treated as ``-inf``. ``None`` = ``V_local * world_size``.

    Returns:
        ``(logprobs, entropy)`` of shape ``targets.shape``, float32 (float64 for float64
        input); ``entropy`` is ``None`` unless ``compute_entropy``. Both are differentiable
        w.r.t. ``logits_shard``.
    """
    if logits_shard.dim() < 1:
        raise ValueError("logits_shard must have a vocabulary dimension")
    if not logits_shard.is_floating_point():
        raise ValueError(f"logits_shard must be floating point, got {logits_shard.dtype}")
    if tuple(targets.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits_shard leading shape "
            f"{tuple(logits_shard.shape[:-1])}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tp_group is None:
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    v_local = logits_shard.shape[-1]
    padded = v_local * world
    if vocab_size is None:
        vocab_size = padded
    vocab_size = int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, V_local * tp_size = {padded}]")
    if chunk_size is None:
        chunk_size = default_chunk_size(v_local, logits_shard.device)
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    tgt = targets.reshape(-1).to(device=logits_shard.device, dtype=torch.long)
    bad = (tgt != ignore_index) & ((tgt < 0) | (tgt >= vocab_size))
    if tgt.device.type != "meta" and bool(bad.any()):  # the one sync (meta, a placement test's CUDA, has no data)
        bad_ids = tgt[bad]
        raise ValueError(
            f"target id {int(bad_ids[0])} is outside the vocabulary [0, {vocab_size}) "
            f"(vocab_size={vocab_size}, {int(bad_ids.numel())} bad position(s); "
            f"ignore_index={ignore_index})"
        )

    x = logits_shard.reshape(-1, v_local)  # a view for contiguous input; never written to
    out = _VocabParallelLogprobs.apply(
        x,
        tgt,
        tp_group,
        rank,
        world,
        float(temperature),
        bool(compute_entropy),
        chunk_size,
        int(ignore_index),
        vocab_size,
    )
    shape = targets.shape
    if compute_entropy:
        logp, ent = out
        return logp.view(shape), ent.view(shape)
    return out.view(shape), None
