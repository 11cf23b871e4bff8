"""init_distributed() reads torchrun's variables first, then Slurm's, else a single local process."""

from mgrpo.parallel.distributed import _first_slurm_host, read_dist_env


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    d = read_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.launcher) == (
        3,
        8,
        1,
        "10.0.0.1",
        1234,
        "torchrun",
    )


def test_slurm_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "5",
        "SLURM_NODELIST": "gpu[003-004,7]",
        "SLURM_JOB_ID": "4242",
    }
    d = read_dist_env(env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.launcher) == (5, 16, 5, "gpu003", "slurm")
    assert d.master_port == 29500 + 4242 % 1000
    assert _first_slurm_host("node1,node2") == "node1"
    assert _first_slurm_host("a-b[10-12]") == "a-b10"


def test_single_process_default():
    d = read_dist_env({})
    assert (d.rank, d.world_size, d.launcher) == (0, 1, "single") and d.master_port > 0


class _Stop(Exception):
    pass


def _cuda_index_chosen(monkeypatch, env: dict, device_count: int) -> int:
    """The CUDA index init_distributed(backend="nccl") selects for `env` on a node whose process sees
    `device_count` GPUs (no GPU here: set_device is recorded and the process group is never made)."""
    import torch
    import torch.distributed as dist

    from mgrpo.parallel import distributed

    chosen = []
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i) or (_ for _ in ()).throw(_Stop()))
    try:
        distributed.init_distributed(backend="nccl")
    except _Stop:
        return chosen[0]
    raise AssertionError("set_device was not called")


def test_each_rank_takes_its_gpu_under_torchrun_and_under_slurm_one_gpu_per_task(monkeypatch):
    """torchrun on a node whose GPUs all show: LOCAL_RANK (also inside a parent CUDA_VISIBLE_DEVICES=4,5,6,7: the
    index, not the physical id). Slurm's `--gpus-per-task=1` / `--gpu-bind=single:1`: the task sees one GPU, by
    CUDA_VISIBLE_DEVICES or by cgroup; set_device(LOCAL_RANK) would fail there, index 0 is the right one."""
    rank = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert _cuda_index_chosen(monkeypatch, rank, 8) == 5
    parent = {**rank, "RANK": "2", "LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert _cuda_index_chosen(monkeypatch, parent, 4) == 2
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "5",
        "SLURM_NODELIST": "gpu1",
        "SLURM_JOB_ID": "7",
    }
    assert _cuda_index_chosen(monkeypatch, {**slurm, "CUDA_VISIBLE_DEVICES": "5"}, 1) == 0
    assert _cuda_index_chosen(monkeypatch, slurm, 1) == 0  # a device cgroup, no CUDA_VISIBLE_DEVICES
