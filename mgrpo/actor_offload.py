"""`train.offload`: the trainer's device memory handed to a colocated engine for its rollout phase, and back.

What moves (`none` | `optimizer` | `optimizer+grads` | `all`): the optimizer's tensors (Adam moments and fp32
main params), the DDP gradient buffers (discarded, reallocated zeroed: every step starts with
`zero_grad_buffer`), and the DDP parameter buffers (copied to host, the values come back bitwise). Each storage
is emptied in place (`untyped_storage().resize_(0)`), so every view of it (params, `main_grad`, bucket views,
optimizer references) stays the same Python object and is valid again after `restore`.

This is what megatron-core 0.16.1 does for its RL loop (`_ParamAndGradBuffer.offload_to_cpu` /
`reload_from_cpu`, `MegatronOptimizer.offload_to_cpu` / `restore_from_cpu`, called in that order by
`megatron/rl/rl_utils.py`), and verl's `verl/utils/megatron_utils.py` (`offload_megatron_model_to_cpu`,
`offload_megatron_optimizer`) by hand, with two changes: the host copies are pinned and allocated once (megatron
pins only the params; its optimizer move is a synchronous `.cpu()` that rebinds `p.data`, which would also break
on a CPU trainer, where `.cpu()` is the tensor itself), and the optimizer's tensors keep their identity.
"""

from __future__ import annotations

import torch

LEVELS = ("none", "optimizer", "optimizer+grads", "all")


def _storages(tensors, skip: set = frozenset()) -> list:
    """Distinct untyped storages behind `tensors` (views share one), not empty, not in `skip` (data pointers)."""
    seen, out = set(skip), []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(s)
    return out


def _optimizer_tensors(optimizer) -> list:
    """Every tensor megatron's optimizer holds: its param groups (fp32 main params) and its state (Adam moments)."""
    inner = [
        o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer]) if getattr(o, "optimizer", None)
    ]
    out = []
    for opt in inner:
        out += [p for group in opt.param_groups for p in group["params"]]
        out += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _ddp_buffers(chunks) -> list:
    return [
        b for c in chunks for b in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", []))
    ]


class Offloader:
    """`offload()` after the weight push, `restore()` before the trainer computes again. Bytes moved per kind are
    returned for the metrics (`memory/offloaded_gb`)."""

    def __init__(self, level: str, chunks: list, optimizer):
        if level not in LEVELS:
            raise ValueError(f"train.offload={level!r}: one of {', '.join(LEVELS)}")
        self.level, self.chunks, self.optimizer = level, chunks, optimizer
        self.hosts: list = []  # host copies, by position, kept across steps (pinned memory is slow to allocate)
        self.parked: list = []  # (storage, nbytes, host copy or None)

    def _plan(self) -> list:
        """(kind, storages, keep values) in the order they move."""
        if self.level == "none":
            return []
        buffers = _ddp_buffers(self.chunks)
        # the DDP buffer's param_data where megatron keeps one (distributed optimizer), else the parameters
        # themselves (they are views of param_data when it exists: counted once)
        model_params = [p for c in self.chunks for p in c.parameters()]
        params = _storages([b.param_data for b in buffers if b.param_data is not None] + model_params)
        param_ptrs = {s.data_ptr() for s in params}
        # fp32 training: the optimizer's params may be the model's own (or views of its buffer); they move with it
        plan = [("optimizer", _storages(_optimizer_tensors(self.optimizer), skip=param_ptrs), True)]
        if self.level in ("optimizer+grads", "all"):
            grads = [b.grad_data for b in buffers if b.grad_data is not None]
            plan.append(("grads", _storages(grads, skip=param_ptrs), False))
        if self.level == "all":
            plan.append(("params", params, True))
        return plan

    def offload(self) -> dict:
        if self.parked:
            raise RuntimeError("the trainer's memory is offloaded already")
        moved, slot = {}, 0
        for kind, storages, keep in self._plan():
            moved[kind] = 0
            for s in storages:
                n, host = s.nbytes(), None
                if keep:
                    if slot == len(self.hosts):
                        self.hosts.append(None)
                    host = self.hosts[slot]
                    if host is None or host.nbytes() != n:
                        pinned = torch.cuda.is_available()
                        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
                        self.hosts[slot] = host
                    host.copy_(s, non_blocking=True)
                    slot += 1
                self.parked.append((s, n, host))
                moved[kind] += n
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every copy is done before its source is freed
        for s, _, _ in self.parked:
            s.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved

    def restore(self) -> None:
        for s, n, host in self.parked:
            s.resize_(n)
            if host is not None:
                s.copy_(host, non_blocking=True)
            else:  # gradients: reallocated zeroed, as megatron's reload_from_cpu does
                s.fill_(0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.parked = []
