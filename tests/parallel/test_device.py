"""Device placement with the `meta` device standing in for CUDA: what the trainer builds for the model comes out on
the device, never on the CPU; CPU objects (metrics, the engine-owner table, sample bytes, export coordinates, the
KL vector) reach collectives only over the CPU group. `checked_collectives` raises on anything else, so these
tests fail on code that sends a CPU tensor over the default (nccl, on a GPU) group."""

import json

import pytest
import torch
import torch.distributed as dist

from mgrpo.parallel import device as dev
from mgrpo.rollout.types import Sample


@pytest.fixture
def meta_device(single_rank):
    """device() = meta, a separate gloo group as the CPU group, collectives checked; restored after."""
    saved = (dev.device(), dev.cpu_group())
    dev.set_device("meta", dev.make_cpu_group())
    try:
        with dev.checked_collectives():
            yield
    finally:
        dev.set_device(*saved)


def samples(n=3):
    return [
        Sample(
            prompt_ids=[1, 2, 3],
            response_ids=[4, 5, 6, 7][: 2 + i % 3],
            loss_mask=[1] * (2 + i % 3),
            rollout_logprobs=[-0.5] * (2 + i % 3),
            group_id=i // 2,
        )
        for i in range(n)
    ]


def test_micro_batches_and_advantages_land_on_the_device(meta_device):
    from mgrpo.data.microbatch import make_microbatches, set_advantages

    ss = samples()
    mbs = make_microbatches(ss, 2, 0, token_weights=[[1.0] * len(s.response_ids) for s in ss], device=dev.device())
    for mb in mbs:
        tensors = {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}
        assert set(tensors) >= {"input_ids", "targets", "loss_mask", "advantages", "rollout_logp", "token_weight"}
        assert {k: v.device.type for k, v in tensors.items()} == {k: "meta" for k in tensors}
    set_advantages(mbs, [0.5, -1.0, 2.0])
    assert all(mb["advantages"].device.type == "meta" for mb in mbs)


def test_the_checker_refuses_a_wrong_device_and_passes_the_right_one(meta_device):
    with pytest.raises(dev.DevicePlacementError, match="cpu tensor .* device group"):
        dist.all_reduce(torch.zeros(2))  # a CPU tensor on the default group: fails under nccl
    with pytest.raises(dev.DevicePlacementError, match="meta tensor .* CPU"):
        dist.all_reduce(torch.zeros(2, device="meta"), group=dev.cpu_group())
    dist.all_reduce(torch.zeros(2, device="meta"))  # a device tensor on a device group: fine
    x = torch.ones(2)
    dist.all_reduce(x, group=dev.cpu_group())  # really runs over gloo
    assert x.tolist() == [1.0, 1.0]


def _metrics():
    from mgrpo.metrics import reduce_last_stage

    out = reduce_last_stage({"entropy": 0.5, "tokens": 4.0, "loss": 1.5}, ["entropy"], ["loss"])
    assert out == pytest.approx({"entropy": 0.5, "loss": 1.5})


def _sample_bytes():
    from mgrpo.parallel.device import share_json

    assert share_json({"a": [1, 2]}, [0]) == [{"a": [1, 2]}]


def _owner_table():
    from mgrpo.rollout.manager import engine_owners

    assert engine_owners("per_dp") == {0: 0}


def _export_coords():
    from mgrpo.weights.export import rank_coords

    assert rank_coords().tolist() == [[0, 0, 0, 0, 0]]


def _kl_vector():
    from mgrpo.data.batching import GenerationBatch, generation_batch_kl

    empty = GenerationBatch(samples(2), [], None, None, None, torch.tensor([0, 0]), [2, 3], False)
    assert generation_batch_kl(empty).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "call", [_metrics, _sample_bytes, _owner_table, _export_coords, _kl_vector], ids=lambda f: f.__name__.strip("_")
)
def test_cpu_objects_go_over_the_cpu_group(meta_device, call):
    call()


def test_without_cuda_the_device_is_the_cpu_and_the_cpu_group_the_default(single_rank):
    assert dev.device() == torch.device("cpu") and dev.cpu_group() is None
    with dev.checked_collectives():
        x = torch.ones(1)
        dist.all_reduce(x)
    assert json.dumps(x.tolist()) == "[1.0]"
