"""model.fusions, train.recompute, train.overlap_*: the fields megatron-core receives for each setting (fused kernels
and overlap only on a GPU; every fusion off on CPU, the exact path), and recompute's gradients equal those of a
model that keeps its activations (selective and full, against the same weights and batch on CPU; a perturbed
weight is caught: the negative control)."""

import types

import pytest
import torch

from mgrpo.models.fast_paths import (
    AttentionChoice,
    attention_choice,
    fusion_overrides,
    grouped_gemm,
    overlap_settings,
    recompute_overrides,
)

ALL = {"rope": True, "wgrad": True}


def test_fusions_are_on_only_with_cuda_and_each_only_where_its_kernel_is():
    on = fusion_overrides("auto", cuda=True, te=True, te_linears=True, moe=True, found=ALL)
    assert on == dict(
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        apply_rope_fusion=True,
        gradient_accumulation_fusion=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        moe_permute_fusion=True,
    )
    assert not any(fusion_overrides("auto", False, True, True, True, ALL).values())  # CPU: the exact path
    assert not any(fusion_overrides("off", True, True, True, True, ALL).values())
    local = fusion_overrides("auto", True, True, te_linears=False, moe=False, found=ALL)  # LoRA / packing
    assert local["bias_activation_fusion"] and local["apply_rope_fusion"] and not local["gradient_accumulation_fusion"]
    no_te = fusion_overrides("auto", True, False, False, True, ALL)
    assert no_te["bias_dropout_fusion"] and not no_te["apply_rope_fusion"] and not no_te["moe_permute_fusion"]
    no_apex = fusion_overrides("auto", True, True, True, False, {"rope": True, "wgrad": False})
    assert not no_apex["gradient_accumulation_fusion"]  # megatron's own output layer would refuse the flag
    assert (
        grouped_gemm(None, True, True) and not grouped_gemm(None, True, False) and not grouped_gemm(None, False, True)
    )
    assert grouped_gemm(True, False, False) and not grouped_gemm(False, True, True)


def test_attention_choice_and_the_plan_agree():
    """TE's spec with TE present; LoRA keeps megatron's linears around TE's attention; packed rows go to TE as THD at
    CP = 1, and stay on our core attention (local, score matrices kept) at CP > 1, as LoRA does; the plan counts the
    attention the run builds (plan.built_attention reads the same choice)."""
    from mgrpo.config import load_config
    from mgrpo.plan import built_attention

    assert attention_choice(False, False, 1, te=False) == AttentionChoice(False, False, False)
    assert attention_choice(False, True, 1, te=False) == AttentionChoice(False, False, False)
    assert attention_choice(False, False, 2, te=True) == AttentionChoice(True, True, False)
    assert attention_choice(False, True, 1, te=True) == AttentionChoice(True, True, True)
    assert attention_choice(True, True, 1, te=True) == AttentionChoice(False, True, True)
    assert attention_choice(True, False, 1, te=True) == AttentionChoice(False, True, False)
    assert attention_choice(False, True, 2, te=True) == AttentionChoice(False, False, False)
    assert attention_choice(True, False, 2, te=True) == AttentionChoice(False, False, False)
    cfg = load_config(argv=["--model.path", "m", "--data.path", "d"], check_files=False)
    for lora, packing, cp, want in [(0, 1, 1, "flash"), (8, 1, 1, "flash"), (0, 1, 2, "local"), (8, 0, 2, "local")]:
        cfg.model.lora.rank, cfg.train.sequence_packing, cfg.parallel.cp = lora, bool(packing), cp
        assert built_attention(cfg) == want, (lora, packing, cp)


def test_recompute_and_overlap_settings_reach_megatrons_config(tiny_model):
    from mgrpo.config import ParallelConfig
    from mgrpo.models.builder import transformer_config

    info = _tiny_info()
    for mode, want in (
        ("none", (None, None, None)),
        ("selective", ("selective", None, None)),
        ("full", ("full", "uniform", 1)),
    ):
        c = transformer_config(info, ParallelConfig(), **recompute_overrides(mode))
        assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == want, mode
    assert transformer_config(info, ParallelConfig(), **recompute_overrides("selective")).recompute_modules == [
        "core_attn"
    ]
    train = types.SimpleNamespace(use_distributed_optimizer=True, overlap_grad_reduce=None, overlap_param_gather=None)
    assert overlap_settings(train, cuda=True) == dict(overlap_grad_reduce=True, overlap_param_gather=True)
    assert overlap_settings(train, cuda=False) == dict(overlap_grad_reduce=False, overlap_param_gather=False)
    plain = types.SimpleNamespace(use_distributed_optimizer=False, overlap_grad_reduce=None, overlap_param_gather=True)
    assert overlap_settings(plain, cuda=True) == dict(overlap_grad_reduce=False, overlap_param_gather=False)


def test_bad_values_are_one_line_each():
    from mgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(
            argv=[
                "--config",
                "examples/tiny_cpu.yaml",
                "--model.fusions",
                "fast",
                "--train.recompute",
                "some",
                "--train.overlap_param_gather",
                "true",
            ],
            check_files=False,
        )
    lines = str(e.value).splitlines()
    assert any("model.fusions='fast'; use auto" in x for x in lines)
    assert any("train.recompute='some'; use none, selective" in x for x in lines)
    assert any("train.overlap_param_gather=true needs train.use_distributed_optimizer" in x for x in lines)


def _tiny_info():
    from mgrpo.models.hf_config import read_model_info

    return read_model_info(_tiny_info.dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_dirs):
    _tiny_info.dir = tiny_dirs("fast_paths_qwen2", family="qwen2", vocab_size=300, num_layers=3)
    return _tiny_info.dir


def _grads(model_dir, parallel, mode: str, perturb: float = 0.0) -> dict:
    from mgrpo.models.builder import build_model
    from mgrpo.models.forward import causal_mask, position_ids
    from mgrpo.weights.load import load_hf

    chunk = build_model(model_dir, parallel, config_overrides=recompute_overrides(mode), use_te=False)[0]
    load_hf([chunk], model_dir)
    if perturb:
        with torch.no_grad():
            next(p for n, p in chunk.named_parameters() if "linear_qkv" in n).add_(perturb)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = chunk(ids, position_ids(2, 24, ids.device), causal_mask(24, ids.device))  # with autograd
    torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).sum().backward()
    return {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


def test_recompute_gives_the_gradients_of_kept_activations(single_rank, tiny_model, monkeypatch):
    """Megatron's checkpointed layers on CPU (its CheckpointFunction runs: 3 core attentions, or 3 layers, per
    forward): every parameter's gradient equals the no-recompute model's within 1e-6 relative (fp32); a 1e-3 change
    to one weight moves them past it (negative control)."""
    from megatron.core.tensor_parallel import random as tp_random

    calls, original = [], tp_random.CheckpointFunction.forward
    monkeypatch.setattr(
        tp_random.CheckpointFunction, "forward", staticmethod(lambda *a, **k: calls.append(1) or original(*a, **k))
    )
    ref = _grads(tiny_model, single_rank, "none")
    assert not calls
    for mode in ("selective", "full"):
        calls.clear()
        got = _grads(tiny_model, single_rank, mode)
        assert len(calls) == 3, (mode, len(calls))  # one per layer (3 layers): the recomputed path ran
        assert got.keys() == ref.keys()
        worst = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)) for n in ref)
        print(f"recompute {mode}: worst relative gradient difference {worst:.2e}")
        assert worst <= 1e-6, mode
    bad = _grads(tiny_model, single_rank, "full", perturb=1e-3)
    worst = max(float((bad[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)) for n in ref)
    assert worst > 1e-6
