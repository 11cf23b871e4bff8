"""Shared fixtures: a one-process gloo world with megatron's parallel state at TP1."""

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

# Work units by their serial wall time, longest first (scripts/test.sh runs two xdist workers).
LONGEST_FIRST = [
    "layout_launches",
    "tests/rollout/test_vllm_lora.py",
    "tests/test_trainer_vllm.py",
    "tests/test_checkpoint.py",
    "tests/rollout/test_remote_engine.py",
    "tests/parallel/test_trainer_layouts.py",
    "tests/rollout/test_collective_sync.py",
    "tests/rollout/test_vllm_engine.py",
    "tests/test_trainer.py",
    "tests/models/test_lora_train.py",
    "tests/models/test_qwen3_moe.py",
    "tests/parallel/test_moe_layouts.py",
]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU machines")
    config.addinivalue_line("markers", "slow: multi-process launch")
    config.addinivalue_line("markers", "slurm: needs a Slurm cluster (tests/slurm_single_node.sh); MGRPO_SLURM_TESTS=1")


# The users of `layout_results`: one xdist worker runs them all, so the session's layout launches run once.
LAYOUT_FILES = {
    "tests/test_actor.py",
    "tests/parallel/test_layouts.py",
    "tests/parallel/test_lora_layouts.py",
    "tests/weights/test_export.py",
}


def work_unit(nodeid: str) -> str:
    """The tests one xdist worker runs together: a module (its module-scoped engines and launches start once), or
    every user of the session's layout launches (they would otherwise run once per worker)."""
    path = nodeid.split("::")[0]
    return "layout_launches" if path in LAYOUT_FILES else path


def pytest_xdist_make_scheduler(config, log):
    """Whole work units per worker, in the order collected (xdist's own `loadgroup` cannot mark node ids under
    pytest 9, which no longer keeps them in `_nodeid`)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "layout_results" in item.fixturenames and item.nodeid.split("::")[0] not in LAYOUT_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses layout_results: add its file to LAYOUT_FILES in conftest.py")
    # the longest units first, so that the two workers finish together (seconds from a serial --durations run)
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))
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
