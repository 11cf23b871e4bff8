"""The layout matrix with experts (Qwen3-MoE, 8 experts, top-2, layer 2 dense): loss, every HF-named gradient
(each expert's by its global index) and the weights after one optimizer step equal the EP1 (TP1) run's at EP2,
TP2xEP2 (with SP, which megatron requires for MoE with TP), PP2xEP2, DP4xEP2 (expert-data-parallel 2) and
CP2xEP2, on megatron's all-to-all token dispatcher over gloo. fp32, abs <= 1e-5.

Router ties: top-k picks could flip between layouts only where the k-th and (k+1)-th expert's scores are within
float noise. The tiny MoE's router is drawn with std 0.5 (mgrpo/models/tiny.py); a sample with a gap below
1e-4 anywhere (HF's own forward, every token, every MoE layer) is drawn again (tests/layout_launch.py), and
`test_inputs_have_no_router_ties` checks the batch that ran.
"""

import pytest
import torch
from layout_check import load_layout
from layout_launch import MIN_ROUTER_GAP, MOE_LAUNCHES, router_gap, run_moe_launches
from test_layouts import check


@pytest.fixture(scope="module")
def moe_results(single_rank, tiny_dirs, tmp_path_factory):
    return run_moe_launches(tiny_dirs, tmp_path_factory)


TRAIN = [
    t.rpartition(":")[2]
    for ts in MOE_LAUNCHES.values()
    for t in ts
    if not t.startswith(("roundtrip", "initexport")) and not t.endswith("swapexperts")
]


@pytest.mark.parametrize("tag", TRAIN)
def test_moe_layout_matches_ep1(moe_results, tag):
    check(moe_results, tag)


def test_moe_negative_control_is_detected(moe_results):
    """Each EP rank holding another EP rank's first expert of the first MoE layer fails the same comparison."""
    with pytest.raises(AssertionError):
        check(moe_results, "ep2-swapexperts")


def test_moe_reference_has_expert_gradients(moe_results):
    ref = load_layout(moe_results, "tp1")
    experts = [n for n in ref["grads"] if ".mlp.experts." in n]
    assert len(experts) == 3 * 8 * 3  # 3 MoE layers x 8 experts x gate/up/down
    assert sum(1 for n in ref["grads"] if n.endswith("mlp.gate.weight")) == 3
    assert "model.layers.2.mlp.gate_proj.weight" in ref["grads"]  # the dense layer
    routed = [n for n in experts if ref["grads"][n].abs().sum() > 0]
    assert len(routed) >= 0.9 * len(experts), f"only {len(routed)} of {len(experts)} experts got tokens"


def test_inputs_have_no_router_ties(moe_results):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_results.model_dir, dtype=torch.float32).eval()
    gap = min(router_gap(model, s.prompt_ids + s.response_ids) for s in moe_results.samples)
    print(f"smallest top-k router gap over the batch: {gap:.2e}")
    assert gap > MIN_ROUTER_GAP


@pytest.mark.parametrize(
    "layout",
    [
        "tp1",
        "ep2",
        "tp2-ep2-sp",
        "per_dp-dp4-ep2.rank0",
        "per_dp-dp4-ep2.rank1",
        "per_dp-dp4-ep2.rank2",
        "per_dp-dp4-ep2.rank3",
    ],
)
def test_moe_round_trip_is_bitwise(moe_results, layout):
    """HF -> megatron (each rank reads only its own experts) -> export (experts gathered over EP) is bitwise; also
    with every DP replica exporting to its own rank (one engine per DP group): EP groups span replicas, so the
    replicas export one after another."""
    import json
    import os

    with open(
        os.path.join(moe_results, f"roundtrip{'_' if layout.startswith('per_dp') else '-'}{layout}.roundtrip.json")
    ) as f:
        r = json.load(f)
    assert r["mismatched"] == [] and r["extra"] == [], r
    # embed, final norm, lm_head; per layer 2 norms, q/k/v/o, q/k norms; 3 MoE layers: router + 8 x 3; 1 dense: 3
    assert r["names"] == 3 + 4 * 8 + 3 * (1 + 8 * 3) + 3


def test_moe_megatron_initialised_export_loads_in_hf(moe_results):
    """A megatron-initialised MoE at TP2xEP2, written by the converter's writer, gives HF's logits."""
    import os

    from transformers import AutoModelForCausalLM

    ours = torch.load(os.path.join(moe_results, "initexport-tp2-ep2-sp.logits.pt"), weights_only=True)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.join(moe_results, "initexport-tp2-ep2-sp.hf"), dtype=torch.float32
    )
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"megatron-init TP2xEP2 MoE export: max |megatron - HF| logit = {diff:.2e}")
    assert diff <= 1e-5


def test_moe_checkpoint_converts_to_hf(moe_results, tmp_path):
    """A TP2xEP2 checkpoint -> launch/convert_to_hf.py (one process, EP1): every expert tensor equals what TP2xEP2
    exported after the same step, and transformers loads the folder (its fused in-memory experts filled from the
    per-expert files) with the logits of a model given those weights directly."""
    import os
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mgrpo.models.qwen3_moe import per_expert_views

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "launch"))
    from convert_to_hf import main

    out = tmp_path / "hf"
    ckpt = os.path.join(moe_results, "ckpt-ckpt:tp2-ep2-sp", "step_000001")
    assert main(["--checkpoint", ckpt, "--output", str(out)]) == 0
    written = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            written.update(load_file(str(out / f)))
    source = load_layout(moe_results, "tp2-ep2-sp")["weights"]
    assert written.keys() == source.keys()
    assert all(torch.equal(written[n], source[n]) for n in source)
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(moe_results.model_dir, dtype=torch.float32).eval()
    views = per_expert_views(dict(reference.named_parameters()))
    with torch.no_grad():
        for name, t in source.items():
            views[name].copy_(t)
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (converted(ids).logits - reference(ids).logits).abs().max().item()
    print(f"MoE converter: max |converted - source| logit = {diff:.2e}")
    assert diff <= 1e-6
