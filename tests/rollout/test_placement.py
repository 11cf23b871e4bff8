"""Engine-to-GPU maps for colocated engines (pure functions, the environments of an 8-GPU node)."""

import pytest

from mgrpo.parallel.device import PlacementError, local_device_index, visible_devices
from mgrpo.rollout.placement import RankDevice, describe, engine_devices, my_device


def torchrun(world: int, **extra):
    """The environment torchrun gives rank r of `world` on one node."""
    return lambda r: dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_PORT="29500", **extra)


def srun_one_gpu_per_task(world: int):
    """srun --ntasks-per-node=8 --gpus-per-task=1: task r sees only its own GPU (Slurm sets the index)."""
    return lambda r: dict(
        SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_LOCALID=str(r), CUDA_VISIBLE_DEVICES=str(r)
    )


def node_ranks(env_of_rank, world: int, device_count: int = 8) -> list:
    """Every rank's device as `my_device` reads it from that rank's environment, on host n0."""
    return [RankDevice("n0", my_device(env_of_rank(r), device_count).device) for r in range(world)]


def dp_groups(world: int, tp: int) -> list:
    """Megatron's order (TP fastest): DP replica d holds global ranks d*tp .. d*tp+tp-1, its owner first."""
    return [list(range(d * tp, d * tp + tp)) for d in range(world // tp)]


def test_dp4_tp2_on_eight_gpus_gives_each_engine_its_replicas_two_gpus():
    ranks = node_ranks(torchrun(8), 8)
    devices = engine_devices(ranks, dp_groups(8, 2), tensor_parallel_size=2)
    assert devices == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert (
        describe(devices, ["n0"] * 4) == "engines: vllm#0 GPUs 0,1; vllm#1 GPUs 2,3; vllm#2 GPUs 4,5; vllm#3 GPUs 6,7"
    )


def test_a_parent_cuda_visible_devices_is_respected():
    ranks = node_ranks(torchrun(4, CUDA_VISIBLE_DEVICES="4,5,6,7"), 4, device_count=4)
    assert engine_devices(ranks, dp_groups(4, 2), 2) == [["4", "5"], ["6", "7"]]
    assert engine_devices(ranks, dp_groups(4, 2), 1) == [["4"], ["6"]]


def test_slurm_one_gpu_per_task():
    """Each task sees one GPU (its own id): it uses CUDA index 0 (set_device(local rank) would fail there), and an
    engine spanning two tasks is given both ids (the child must be allowed to see them: --gpu-bind=none or
    ConstrainDevices off; docs/gpu.md)."""
    env = srun_one_gpu_per_task(8)
    assert [local_device_index(r, visible_devices(env(r), 1)) for r in range(8)] == [0] * 8
    ranks = node_ranks(env, 8, device_count=1)
    assert engine_devices(ranks, dp_groups(8, 2), 2) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    uuids = lambda r: dict(torchrun(2)(r), CUDA_VISIBLE_DEVICES=f"GPU-{r:04d}")  # noqa: E731
    ranks = node_ranks(uuids, 2, device_count=1)
    assert engine_devices(ranks, [[0, 1]], 2) == [["GPU-0000", "GPU-0001"]]


def test_rank0_placement_takes_the_first_gpus_of_rank0s_node():
    ranks = [RankDevice("n0", str(r)) for r in range(8)] + [RankDevice("n1", str(r)) for r in range(8)]
    assert engine_devices(ranks, [list(range(16))], 4) == [["0", "1", "2", "3"]]


def test_an_engine_larger_than_its_replica_is_refused_in_one_line():
    ranks = [RankDevice("n0", str(r)) for r in range(8)]
    with pytest.raises(PlacementError, match="engine 0 .* needs 4 GPUs .* hold 2 .*tensor_parallel_size <= 2"):
        engine_devices(ranks, dp_groups(8, 2), 4)
    with pytest.raises(PlacementError, match="local rank 3 but this process sees 2 GPUs"):
        local_device_index(3, visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}))


def test_without_the_map_every_engine_would_share_gpu0():
    """Negative control: devices read without the local rank (what every engine inherited before) collide."""
    ranks = [RankDevice("n0", "0")] * 8
    with pytest.raises(PlacementError, match="engine 0 .* needs 2 GPUs"):
        engine_devices(ranks, dp_groups(8, 2), 2)
    with pytest.raises(PlacementError, match="would share GPU 0"):
        engine_devices(ranks, dp_groups(8, 2), 1)


def test_on_cpu_there_is_no_map():
    ranks = [RankDevice("n0", None)] * 2
    devices = engine_devices(ranks, [[0], [1]], 1)
    assert devices == [[], []] and describe(devices, ["n0", "n0"]) == "engines: on CPU (no GPUs)"
