"""Shared fixtures: a one-process gloo world with megatron's parallel state at TP1."""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU machines")
    config.addinivalue_line("markers", "slow: multi-process launch")
    config.addinivalue_line("markers", "slurm: needs a Slurm cluster (tests/slurm_single_node.sh); MGRPO_SLURM_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `keywords`: that holds folder names too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def single_rank():
    """World size 1 on gloo, TP=PP=CP=1; shared by every in-process megatron test."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(k, None)
    from mgrpo.config import ParallelConfig
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel

    init_distributed()
    setup_model_parallel(ParallelConfig())
    return ParallelConfig()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny HF folders made once per session, by name."""
    from mgrpo.models.tiny import make_tiny_hf

    root = tmp_path_factory.mktemp("tiny")
    made = {}

    def get(name, **kw):
        if name not in made:
            made[name] = make_tiny_hf(str(root / name), **kw)
        return made[name]

    return get


@pytest.fixture(scope="session")
def layout_results(single_rank, tiny_dirs, tmp_path_factory):
    """Every multi-process layout run, once per session (see tests/layout_launch.py)."""
    from layout_launch import run_all_launches

    return run_all_launches(tiny_dirs, tmp_path_factory)
