"""OMP_WAIT_POLICY=PASSIVE only when a node's ranks x OpenMP threads outnumber its cores, never over the user's."""
import os

import pytest

from mgrpo.parallel.omp import local_ranks, passive_wait_if_oversubscribed


@pytest.fixture
def env(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    return monkeypatch


@pytest.mark.parametrize("ranks,threads,user,expect", [("2", "2", None, "PASSIVE"), ("1", "2", None, None),
                                                       ("4", "1", None, "PASSIVE"), ("2", "1", None, None),
                                                       ("2", "2", "ACTIVE", "ACTIVE")])
def test_passive_only_when_oversubscribed(env, ranks, threads, user, expect):
    env.setenv("LOCAL_WORLD_SIZE", ranks)
    env.setenv("OMP_NUM_THREADS", threads)
    if user:
        env.setenv("OMP_WAIT_POLICY", user)
    assert passive_wait_if_oversubscribed() == (expect == "PASSIVE" and user is None)
    assert os.environ.get("OMP_WAIT_POLICY") == expect


def test_slurm_tasks_per_node_forms(env):
    env.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert local_ranks() == 4
    env.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_ranks() == 8
