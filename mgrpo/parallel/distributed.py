"""Start torch.distributed from torchrun or Slurm variables (nccl with CUDA, gloo without) and choose the one
device (`mgrpo.parallel.device`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as 'node[003-005,7],gpu1' -> 'node003'."""
    from mgrpo.parallel.slurm import SlurmPlanError, expand_nodelist

    try:
        return expand_nodelist(nodelist)[0]
    except SlurmPlanError as exc:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}: {exc}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_dist_env(environ=None) -> DistEnv:
    """torchrun variables win; else Slurm's; else a single local process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
            "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1"))
        port = int(env.get("MASTER_PORT", 29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        return DistEnv(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm"
        )
    return DistEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 0)) or free_port(), "single")


def shutdown_distributed() -> None:
    """Megatron's groups and the default process group destroyed, where they exist (at the end of a run)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def restart_store(denv: DistEnv, timeout):
    """The rendezvous store of a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0), keyed by the attempt; None
    otherwise (torch's own env:// store). torchrun's static rendezvous (`--nproc-per-node N`, `--master-port`) keeps
    one agent store across restarts and its workers join it without a per-attempt prefix (torch 2.13
    `rendezvous._create_c10d_store`), so a restarted rank reads its peers' gloo/NCCL addresses from the failed
    attempt and its connect is refused (measured: `Gloo connectFullMesh failed ... Connection refused`)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/mgrpo/attempt_{attempt}", client)


def init_distributed(backend: str | None = None, timeout_minutes: int = 30, hang_dir: str | None = None) -> DistEnv:
    """Initialise the default process group once; returns the environment it used. `hang_dir`: with NCCL, torch's
    flight recorder dumps there on a collective timeout (parallel/watchdog.nccl_diagnostics_env)."""
    denv = read_dist_env()
    if dist.is_initialized():
        return denv
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    index = 0
    if backend == "nccl":  # LOCAL_RANK, or 0 where Slurm bound one GPU to the task (set_device(LOCAL_RANK) fails)
        from mgrpo.parallel.device import local_device_index, visible_devices

        index = local_device_index(denv.local_rank, visible_devices(device_count=torch.cuda.device_count()))
        torch.cuda.set_device(index)
        if hang_dir:
            from mgrpo.parallel.watchdog import nccl_diagnostics_env

            os.makedirs(hang_dir, exist_ok=True)
            os.environ.update(nccl_diagnostics_env(hang_dir, os.environ))
    else:
        from mgrpo.parallel.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    os.environ.update(
        MASTER_ADDR=denv.master_addr,
        MASTER_PORT=str(denv.master_port),
        RANK=str(denv.rank),
        WORLD_SIZE=str(denv.world_size),
        LOCAL_RANK=str(denv.local_rank),
    )
    from datetime import timedelta

    # a single process needs no rendezvous: an in-memory store, so no port can be taken between free_port() and
    # the bind (a vLLM server starting beside it grabs ports too); several ranks meet on MASTER_ADDR:MASTER_PORT
    store = dist.HashStore() if denv.launcher == "single" else restart_store(denv, timedelta(minutes=timeout_minutes))
    dist.init_process_group(
        backend=backend,
        rank=denv.rank,
        world_size=denv.world_size,
        store=store,
        timeout=timedelta(minutes=timeout_minutes),
    )
    from mgrpo.parallel.device import make_cpu_group, set_device

    if backend == "nccl":  # model tensors on this rank's GPU; CPU objects over a gloo side group
        set_device(f"cuda:{index}", make_cpu_group())
    else:
        set_device("cpu")
    return denv
