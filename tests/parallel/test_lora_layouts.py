"""LoRA across layouts: loss, every adapter gradient (PEFT names, TP shards gathered) and the merged weights after
one optimizer step equal the TP1 LoRA run's at TP2, TP2+SP, PP2, TP2xPP2, TP2xPP2xVPP2+SP and TP2xDP2 with the
distributed optimizer (abs <= 1e-5, rel <= 1e-4). The adapters come from HF+PEFT with B random, so every factor
gets a gradient. Launches are shared with the layout matrix (tests/layout_launch.py).

The merged weights' relative test floors at 1e-2 (gradients keep 1e-3): Adam (eps 1e-3, lr 1e-2) turns 1e-8 of
fp32 order noise in a near-zero factor gradient into ~1e-7 of update, which B·A carries into weights near zero."""

import pytest
from layout_check import load_layout
from layout_launch import LAUNCHES
from test_layouts import ABS, REL_FLOOR, compare

WEIGHT_REL_FLOOR = 1e-2


def check(out, tag):
    ref, got = load_layout(out, "tp1-lora"), load_layout(out, tag)
    assert abs(got["loss"] - ref["loss"]) <= ABS, f"loss {got['loss']} vs {ref['loss']}"
    g = compare(ref["grads"], got["grads"], "adapter grad", REL_FLOOR) if got["grads"] else None
    w = compare(ref["weights"], got["weights"], "merged weight after step", WEIGHT_REL_FLOOR)
    print(f"{tag}: loss {got['loss']:.8f} (tp1 {ref['loss']:.8f}) max grad diff {g} max weight diff {w:.2e}")


LORA_TAGS = [
    "lora-" + t.split(":")[1]
    for ts in LAUNCHES.values()
    for t in ts
    if t.startswith("lora:") and not t.endswith("loraswap")
]


@pytest.mark.parametrize("tag", LORA_TAGS)
def test_lora_layout_matches_tp1(layout_results, tag):
    check(layout_results, tag)


def test_lora_negative_control_is_detected(layout_results):
    """Each TP rank holding another rank's rows of layer 0's q_proj B fails the same comparison."""
    with pytest.raises(AssertionError):
        check(layout_results, "lora-tp2-loraswap")


def test_lora_reference_trains_adapters_only(layout_results):
    """TP1: a gradient for every factor (4 layers x 7 modules x A, B) and none for the base; after the step only
    the adapted linears' merged weights moved (norms and embeddings are the checkpoint's, bit for bit)."""
    from mgrpo.weights.load import SafetensorsReader

    ref = load_layout(layout_results, "tp1-lora")
    assert len(ref["grads"]) == 4 * 7 * 2
    assert all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in ref["grads"])
    assert all(g.abs().sum() > 0 for g in ref["grads"].values()), "every factor gets a gradient"
    before = SafetensorsReader(layout_results.model_dir)
    for name, w in ref["weights"].items():
        adapted = name.endswith("_proj.weight")
        moved = float((w - before.read(name)).abs().max())
        assert (moved > 1e-4) if adapted else moved == 0.0, f"{name}: moved {moved}"
