"""Make megatron-core run on CPU with gloo, without touching its files.

Applied only when CUDA is absent (each patch below names the megatron-core 0.16.1 call it answers):
RNG calls routed to the CPU generator, `torch.cuda.current_device()` answering "cpu", a no-op
`synchronize`, and a TorchFunctionMode that maps hard-coded `device="cuda"`, `.cuda()` and
`pin_memory=True` to CPU and lets `tensor.type()` checks for `torch.cuda.FloatTensor` pass. CUDA streams are
one in-order host stream (megatron's MoE all-to-all dispatcher copies token counts on a side stream and syncs
on an event: on CPU the copies are already done, so every stream is the same no-op stream).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_REWRITTEN = {torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to}  # what may name CUDA without keywords


@contextlib.contextmanager
def without_shims():
    """Plain torch for code that is not megatron's (the HF engine's forward and sampling): no mode on each op."""
    if not _APPLIED:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements inside megatron into CPU ones; everything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and func not in _REWRITTEN:  # nearly every op: the mode costs a Python call per op
            return func(*args)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
            return func(*args, **kwargs)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _HostStream:
    """torch.cuda.Stream / current_stream / record_event on CPU: work is in order, so nothing waits. A class (one
    instance), as modules annotate with `torch.cuda.Stream | None`."""

    _one = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return self

    def synchronize(self):
        return None

    def query(self):
        return True


_HOST_STREAM = _HostStream()


class _StreamContext:
    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return _HOST_STREAM

    def __exit__(self, *exc):
        return False


def _as_host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's maybe_move_tensor_to_cpu converts only CUDA tensors to numpy; the all-to-all's split sizes must be
    a sequence of ints on CPU too (a CPU tensor is refused by all_to_all_single)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _uneven_gather(original):
    """megatron's `_gather_along_first_dim` with `output_split_sizes` hands all_gather parts of different lengths
    (NCCL takes them, gloo refuses): on gloo, gather parts padded to the longest, then cut each to its length."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = int(max(output_split_sizes))
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[: int(n)] for p, n in zip(parts, output_split_sizes)])

    return gather


def _uneven_reduce_scatter(original):
    """The inverse with `input_split_sizes`: on gloo, sum the whole tensor over the group and keep this rank's part."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()
        torch.distributed.all_reduce(full, group=group)
        start = int(sum(input_split_sizes[: group.rank()]))
        return full[start : start + int(input_split_sizes[group.rank()])].clone()

    return reduce_scatter


def apply_cpu_shims() -> bool:
    """Patch torch/megatron for CPU. Returns True if patches were applied (idempotent)."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.device_count = lambda: 0
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.stream = _StreamContext

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _as_host_splits
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process
    _APPLIED = True
    return True
