"""Which GPUs each colocated engine sees: the trainer's own devices, never GPU 0 for everyone.

A colocated engine (`rollout.engine: vllm`) is a child process of its owner rank (`rollout/manager.py`:
`engine_owners`). It inherits the owner's environment, so without a `CUDA_VISIBLE_DEVICES` of its own every
engine starts on the first visible GPU. Here each engine gets the physical devices of the trainer ranks whose
model-parallel group it serves (`per_dp`: the TP x PP x CP ranks of its data-parallel replica; `rank0`: the
ranks of rank 0's node, in local-rank order), the first `tensor_parallel_size` of them, on the owner's host.

A rank's physical device is read the way CUDA reads it: the parent's `CUDA_VISIBLE_DEVICES` (indices or
`GPU-<uuid>`), entry `LOCAL_RANK` when every rank sees the node's GPUs, or its only entry under Slurm's per-task
binding (`--gpus-per-task=1`, `--gpu-bind=single:1`: each task sees one GPU). verl places engines with Ray
bundles (`verl/single_controller/ray/base.py`), slime gives SGLang a `base_gpu_id` per engine
(`slime/ray/rollout.py`); mgrpo has no scheduler of its own, so it derives the map from what torchrun or srun
already bound. Pure functions: the tests drive them with the environments of an 8-GPU node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mgrpo.parallel.device import PlacementError, local_device_index, visible_devices
from mgrpo.parallel.distributed import read_dist_env


@dataclass(frozen=True)
class RankDevice:
    """Where one trainer rank runs: its host and the physical GPU id CUDA gave it (None on CPU)."""

    host: str
    device: str | None


def my_device(env=None, device_count: int = 0) -> RankDevice:
    """This rank's host and physical GPU (None without GPUs)."""
    env = os.environ if env is None else env
    visible = visible_devices(env, device_count)
    local_rank = read_dist_env(env).local_rank
    device = visible[local_device_index(local_rank, visible)] if visible else None
    return RankDevice(socket.gethostname(), device)


def engine_devices(ranks: list[RankDevice], groups: list[list[int]], tensor_parallel_size: int) -> list[list[str]]:
    """Physical GPU ids per engine. `ranks[r]` is global rank r's device; `groups[e]` lists the global ranks whose
    GPUs engine e may use, its owner first (the owner's host is the engine's host). Each engine takes the first
    `tensor_parallel_size` distinct GPUs of its group on the owner's host; no two engines share a GPU."""
    taken: dict[tuple[str, str], int] = {}
    out = []
    for e, group in enumerate(groups):
        owner = ranks[group[0]]
        if owner.device is None:
            out.append([])
            continue
        mine: list[str] = []
        for r in group:
            if ranks[r].host == owner.host and ranks[r].device not in mine:
                mine.append(ranks[r].device)
        if len(mine) < tensor_parallel_size:
            raise PlacementError(
                f"engine {e} (owner rank {group[0]} on {owner.host}) needs {tensor_parallel_size} GPUs "
                f"(rollout.vllm.tensor_parallel_size) but its trainer ranks there hold {len(mine)} ({','.join(mine)}); "
                f"set rollout.vllm.tensor_parallel_size <= {len(mine)}, or use engine_placement per_dp with "
                f"tp x pp >= the engine's TP"
            )
        mine = mine[:tensor_parallel_size]
        for d in mine:
            if (owner.host, d) in taken:
                raise PlacementError(
                    f"engines {taken[(owner.host, d)]} and {e} would share GPU {d} on {owner.host}; "
                    f"lower rollout.vllm.tensor_parallel_size"
                )
            taken[(owner.host, d)] = e
        out.append(mine)
    return out


def engine_groups(placement: str, dp_of_rank: list, owners: dict) -> list:
    """The global ranks whose GPUs each engine may use, its owner first: `per_dp`, the ranks of its own
    data-parallel replica; `rank0`, every rank (`engine_devices` keeps those on rank 0's host)."""
    if placement == "rank0":
        return [list(range(len(dp_of_rank)))]
    return [[o] + [r for r, d in enumerate(dp_of_rank) if d == dp and r != o] for dp, o in owners.items()]


def planned_devices(cfg, dp_of_rank: list, gpus_per_node: int = 8) -> tuple:
    """The map `start_engine` will print, for `--print-plan`: ranks fill nodes of `gpus_per_node` GPUs in order,
    rank r on GPU r mod gpus_per_node (torchrun's local ranks on nodes whose GPUs are all visible)."""
    world = len(dp_of_rank)
    ranks = [RankDevice(f"node{r // gpus_per_node}", str(r % gpus_per_node)) for r in range(world)]
    owners = {0: 0} if cfg.rollout.engine_placement == "rank0" else {}
    for r, d in enumerate(dp_of_rank):
        owners.setdefault(d, r)  # the lowest rank of a replica is its first stage's TP/CP rank 0
    groups = engine_groups(cfg.rollout.engine_placement, dp_of_rank, owners)
    devices = engine_devices(ranks, groups, cfg.rollout.vllm.tensor_parallel_size)
    return devices, [ranks[g[0]].host for g in groups]


def describe(devices: list[list[str]], hosts: list[str], name: str = "vllm") -> str:
    """One line for the run header and `--print-plan`: which engine holds which GPUs."""
    parts = [
        f"{name}#{e} GPUs {','.join(d)}" + (f" on {h}" if len(set(hosts)) > 1 else "")
        for e, (d, h) in enumerate(zip(devices, hosts))
    ]
    return "engines: " + ("; ".join(parts) if any(devices) else "on CPU (no GPUs)")
