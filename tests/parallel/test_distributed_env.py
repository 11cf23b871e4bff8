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
