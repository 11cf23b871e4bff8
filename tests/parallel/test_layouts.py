"""The layout matrix: loss, every HF-named gradient, and the weights after one optimizer step equal the
TP1 run's at TP2, TP2+SP, PP2, PP2xVPP2, DP2 (plain and distributed optimizer), TP2xPP2 and TP2xPP2xDP2,
at TP2 and DP2 with the distributed optimizer without megatron's gloo DP groups (`-nogloo`: the groups as
under CUDA with nccl, so the optimizer must not ask for them),
for the loss presets / sequence-level losses (`-loss_*` tags) at DP2, TP2, PP2, PP2xVPP2 and TP2xDP2, and
with context parallelism at CP2, TP2xCP2, DP2xCP2 and PP2xCP2 (ppo_clip token-mean and gspo).

A fixed global batch of 8 samples with unequal lengths goes through 4 micro-batches on every rank; old
logprobs are the TP1 model's plus noise, so PPO ratios leave the clip range and both branches are exercised.
"""

import pytest
from layout_check import load_layout
from layout_launch import LAUNCHES

ABS, REL, REL_FLOOR = 1e-5, 1e-4, 1e-3  # rel = |diff| / max(|ref|, REL_FLOOR)
# Weights after the step are compared relative to max(|w|, lr): the runs' first Adam step (lr 1e-2, eps 1e-3) moves
# a weight by lr * g / (|g| + eps), which multiplies a small gradient's fp32 order noise by up to lr / eps = 10
# (seen: a 1.9e-4 gradient 3.6e-8 apart at TP2xEP2+SP, within the gradient test, gave weights 1.5e-7 apart at
# |w| = 1.3e-3). The gradients themselves keep REL_FLOOR; a wrong update is off by ~lr, far outside either.
STEP_REL_FLOOR = 1e-2


def compare(ref: dict, got: dict, what: str, rel_floor: float = REL_FLOOR) -> float:
    assert ref.keys() == got.keys(), f"{what}: names differ: {sorted(ref.keys() ^ got.keys())[:5]}"
    worst = 0.0
    for name in ref:
        a, b = got[name].double(), ref[name].double()
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        diff = (a - b).abs()
        rel = diff / b.abs().clamp_min(rel_floor)
        assert diff.max() <= ABS and rel.max() <= REL, (
            f"{what} {name}: max abs {diff.max():.2e} rel {rel.max():.2e} (tol {ABS}, {REL})"
        )
        worst = max(worst, float(diff.max()))
    return worst


NEGATIVE = ("wrongshard", "localseq", "nozigzag", "rankq", "crossattn")


def reference_tag(tag: str) -> str:
    if tag.startswith("lora-"):
        return "tp1-lora"
    if tag.startswith("mb"):
        return "tp1-" + tag.split("-", 1)[0]
    loss = next((p for p in tag.split("-") if p.startswith("loss_") or p == "topent"), None)
    return f"tp1-{loss}" if loss else "tp1"


def check(out, tag, rel_floor=REL_FLOOR):
    ref, got = load_layout(out, reference_tag(tag)), load_layout(out, tag)
    assert abs(got["loss"] - ref["loss"]) <= ABS, f"loss {got['loss']} vs {ref['loss']}"
    g = compare(ref["grads"], got["grads"], "grad", rel_floor) if got["grads"] else None
    w = compare(ref["weights"], got["weights"], "exported weight after step", max(rel_floor, STEP_REL_FLOOR))
    print(f"{tag}: loss {got['loss']:.8f} (tp1 {ref['loss']:.8f}) max grad diff {g} max weight diff {w:.2e}")


TRAIN_LAYOUTS = [
    t.rpartition(":")[2]
    for ts in LAUNCHES.values()
    for t in ts
    if not t.endswith(NEGATIVE) and not t.startswith(("roundtrip", "initexport", "nanstep", "mb", "lora"))
]


@pytest.mark.parametrize("tag", TRAIN_LAYOUTS)
def test_layout_matches_tp1(layout_results, tag):
    check(layout_results, tag)


@pytest.mark.parametrize("tag", ["mb2-tp2-pp2", "mb4-tp2-pp2"])
def test_first_mini_batch_matches_tp1(layout_results, tag):
    """A generation batch split into 2 or 4 mini-batches: the first one's loss, gradients and post-step weights
    at TP2xPP2 equal TP1's (aggregation counts from that mini-batch alone). abs <= 1e-5; the relative test
    floors at 1e-2 here: a 2-sample mini-batch has gradients of 1e-3 and below, where fp32 order noise is 1e-7."""
    check(layout_results, tag, rel_floor=1e-2)
    full, first = load_layout(layout_results, "tp1"), load_layout(layout_results, reference_tag(tag))
    assert abs(full["loss"] - first["loss"]) > 1e-4, "the mini-batch is a different batch from the whole"


@pytest.mark.parametrize(
    "tag", ["tp2-wrongshard", "cp2-loss_gspo-localseq", "cp2-nozigzag", "dp2-topent-rankq", "cp2-pack-crossattn"]
)
def test_negative_controls_are_detected(layout_results, tag):
    """A shard from the wrong TP rank, GSPO's sequence ratio reduced per CP rank instead of across the CP
    group, a contiguous (not zigzag) CP split, and the entropy mask's quantile taken per DP rank instead of over
    the DP group each fail the same comparison."""
    with pytest.raises(AssertionError):
        check(layout_results, tag)


def test_reference_has_gradients(layout_results):

    from mgrpo.weights.load import SafetensorsReader

    ref = load_layout(layout_results, "tp1")
    assert len(ref["grads"]) == 3 + 4 * 12  # embed, norm, lm_head; per layer 2 norms, q/k/v w+b, o, gate, up, down
    assert all(g.abs().sum() > 0 for n, g in ref["grads"].items()), "every parameter gets a gradient"
    before = SafetensorsReader(layout_results.model_dir)
    moved = max(float((ref["weights"][n] - before.read(n)).abs().max()) for n in ref["weights"])
    assert moved > 1e-3, "the optimizer step must move weights far beyond the comparison tolerance"
