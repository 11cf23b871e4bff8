"""Make megatron-core run on CPU with gloo, without touching its files.

Applied only when CUDA is absent (see ../shared/CPU_FACTS.md for what each patch answers):
RNG calls routed to the CPU generator, `torch.cuda.current_device()` answering "cpu", a no-op
`synchronize`, and a TorchFunctionMode that maps hard-coded `device="cuda"`, `.cuda()` and
`pin_memory=True` to CPU and lets `tensor.type()` checks for `torch.cuda.FloatTensor` pass.
"""
from __future__ import annotations

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


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements inside megatron into CPU ones; everything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
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

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process
    _APPLIED = True
    return True
