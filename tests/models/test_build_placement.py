"""The GPU branch of the model build, taken on CPU: with `use_cpu_initialization=False` megatron builds on
`torch.cuda.current_device()` and never moves the model, so every parameter and buffer of every family must
come out on the run's device. `meta` stands in for CUDA (the run's device and what current_device answers)."""

import pytest
import torch

from mgrpo.parallel import device as dev

FAMILIES = {
    "qwen2": {},
    "qwen3": {},
    "llama": {
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    },
}


@pytest.fixture
def meta_as_cuda(single_rank, monkeypatch):
    """device() = meta and torch.cuda.current_device() -> meta; restored after."""
    saved = (dev.device(), dev.cpu_group())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    dev.set_device("meta", saved[1])
    try:
        yield
    finally:
        dev.set_device(*saved)


def placements(chunks) -> dict:
    return {
        f"{i}.{name}": t.device.type
        for i, c in enumerate(chunks)
        for named in (c.named_parameters(), c.named_buffers())
        for name, t in named
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_and_buffer_lands_on_the_device(meta_as_cuda, tiny_dirs, family, tied):
    from mgrpo.models.builder import build_model, transformer_config
    from mgrpo.models.hf_config import read_model_info

    path = tiny_dirs(f"place-{family}-{tied}", family=family, tie_word_embeddings=tied, **FAMILIES[family])
    info = read_model_info(path)
    assert transformer_config(info, single_parallel()).use_cpu_initialization is False
    chunks = build_model(path, single_parallel())
    got = placements(chunks)
    assert len(got) > 10
    assert {k: v for k, v in got.items() if v != "meta"} == {}


def test_the_check_names_the_first_tensor_off_the_device():
    """Negative control for the build's own check: a norm left on the CPU is named."""
    from mgrpo.models.builder import PlacementError, check_placement

    model = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), torch.nn.RMSNorm(2))
    with pytest.raises(PlacementError, match=r"parameter 1\.weight \(2,\) is on cpu, the run's device is meta"):
        check_placement([model], torch.device("meta"))
    check_placement([model.to("meta")], torch.device("meta"))


def single_parallel():
    from mgrpo.config import ParallelConfig

    return ParallelConfig()
