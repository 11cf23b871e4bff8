"""OMP_WAIT_POLICY: PASSIVE on machines without NVIDIA GPUs and on oversubscribed GPU nodes, never over the user's
(mgrpo/parallel/omp.py has the measurements behind the choice)."""

import os

import pytest

from mgrpo.parallel import omp
from mgrpo.parallel.omp import choose_wait_policy, local_ranks


@pytest.fixture
def env(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    return monkeypatch


@pytest.mark.parametrize(
    "gpu,ranks,threads,user,expect",
    [
        (False, "1", "2", None, "PASSIVE"),
        (False, "2", "2", None, "PASSIVE"),
        (False, "1", "2", "ACTIVE", "ACTIVE"),
        (True, "1", "2", None, None),
        (True, "2", "2", None, "PASSIVE"),
        (True, "4", "1", None, "PASSIVE"),
        (True, "2", "2", "ACTIVE", "ACTIVE"),
    ],
)
def test_wait_policy(env, gpu, ranks, threads, user, expect):
    env.setattr(omp, "has_nvidia_gpu", lambda: gpu)
    env.setenv("LOCAL_WORLD_SIZE", ranks)
    env.setenv("OMP_NUM_THREADS", threads)
    if user:
        env.setenv("OMP_WAIT_POLICY", user)
    assert choose_wait_policy() == expect
    assert os.environ.get("OMP_WAIT_POLICY") == expect


def test_slurm_tasks_per_node_forms(env):
    env.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert local_ranks() == 4
    env.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_ranks() == 8
