"""The actor never lets a non-finite gradient reach the weights (issue: trust pass, item 9).

At TP2 x PP2 (4 ranks, in the shared layout launch) a step where one micro-batch's loss is NaN leaves every
rank's parameters, Adam's moments and step count, and the learning rates bitwise unchanged; the next step trains
normally. With the guard off (negative control) megatron-core's optimizer steps on the NaN gradient.
"""

import glob
import json
import os


def _ranks(out, tag):
    files = sorted(glob.glob(os.path.join(out, f"{tag}.rank*.json")))
    assert len(files) == 4, f"expected 4 rank results for {tag}, found {files}"
    return [json.load(open(f)) for f in files]


def test_nan_step_is_skipped_on_every_rank_at_tp2_pp2(layout_results):
    for r in _ranks(layout_results, "nanstep-tp2-pp2"):
        print(r)
        assert r["first_ok"] and not r["bad_ok"] and r["skipped"] == 1
        assert r["n_changed"] == 0, f"rank {r['rank']}: the NaN step changed {r['changed']}"
        assert r["n_optimizer_tensors"] > 0, "the snapshot must include Adam's state"
        assert r["next_ok"] and r["next_finite"] and r["next_moved"]


def test_without_the_guard_the_nan_step_reaches_the_weights(layout_results):
    ranks = _ranks(layout_results, "nanstep_noguard-tp2-pp2")
    assert all(r["n_changed"] > 0 for r in ranks), "megatron steps on NaN gradients: the guard is what stops it"
    assert not all(r["next_finite"] for r in ranks)
