"""Megatron `parallel_state` set-up from our ParallelConfig."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel


def setup_model_parallel(parallel, seed: int = 1234, gloo_groups: bool | None = None) -> None:
    """Create TP/PP/VPP/CP/EP/DP groups (idempotent) and seed the model-parallel RNG. Megatron's gloo DP groups
    are made where the default group is gloo (`gloo_groups` None), as on CPU; not beside nccl (tests pass False
    to take that branch on CPU)."""
    if gloo_groups is None:
        gloo_groups = not torch.cuda.is_available() or dist.get_backend() == "gloo"
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp and parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        create_gloo_process_groups=gloo_groups,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def gloo_groups_created() -> bool:
    """Whether `initialize_model_parallel` made megatron's gloo DP groups. Under CUDA with nccl it does not
    (`create_gloo_process_groups=False` above), and megatron's optimizer must then be told not to ask for them
    (`use_gloo_process_groups`), or it asserts "Intra partial data parallel group is not initialized"."""
    try:
        mpu.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)
    except AssertionError:
        return False
    return True


def holds_metrics() -> bool:
    """Last-stage TP0 ranks hold the loss metrics (every CP rank its own tokens' share)."""
    return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0


def teardown_model_parallel() -> None:
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
