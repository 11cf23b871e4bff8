"""Advantage estimators against plain Python reimplementations (float64 loops over groups) from the formulas:

grpo: (r - mean_g) / (std_g + 1e-4) | / (std_batch(r) + 1e-4) | unscaled
rloo: r_i - mean of the other valid members (then the same scaling as grpo)
reinforce_plus_plus: (r - mean_g) / (std_batch(r - mean_g) + 1e-4) by default (batch), group / none as grpo
Invalid (NaN / inf) rewards: advantage 0, excluded from every statistic; groups with < 2 valid members: 0.
Outputs are float32 by contract, so values are compared at float32 precision.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mgrpo.loss.advantages import DEFAULT_SCALE_REWARDS, STD_EPS, valid_mask
from mgrpo.loss.registry import advantages

NAN, INF = float("nan"), float("inf")


def _std(xs):
    if len(xs) < 2:
        return 0.0
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def reference(name, rewards, gids, scale):
    rewards, gids = list(map(float, rewards)), list(map(int, gids))
    ok = [math.isfinite(r) for r in rewards]
    members = {}
    for i, g in enumerate(gids):
        if ok[i]:
            members.setdefault(g, []).append(rewards[i])
    adv = []
    for i, g in enumerate(gids):
        rs = members.get(g, [])
        if not ok[i] or len(rs) < 2:
            adv.append(0.0)
            continue
        if name == "rloo":
            others = list(rs)
            others.remove(rewards[i])
            adv.append(rewards[i] - sum(others) / len(others))
        else:
            adv.append(rewards[i] - sum(rs) / len(rs))
    if scale == "group":
        adv = [a / (_std(members.get(g, [])) + STD_EPS) if a != 0.0 else 0.0 for a, g in zip(adv, gids)]
    elif scale == "batch":
        basis = (
            [a for a, v in zip(adv, ok) if v]
            if name == "reinforce_plus_plus"
            else [r for r, v in zip(rewards, ok) if v]
        )
        sd = _std(basis)
        adv = [a / (sd + STD_EPS) for a in adv]
    return torch.tensor(adv, dtype=torch.float64)


CASES = {
    "plain": ([1.0, 0.0, 0.5, 2.0, 3.0, -1.0, 0.25, 0.75], [0, 0, 0, 0, 1, 1, 1, 1]),
    "uneven_unordered_ids": ([0.3, 1.2, -0.7, 2.2, 0.9, 0.1, 5.0], [7, 3, 7, 3, 3, 11, 7]),
    "equal_group_and_singleton": ([1.0, 1.0, 1.0, 0.0, 2.0, 4.0, 9.0], [0, 0, 0, 1, 1, 1, 2]),
    "nan_and_inf": ([1.0, NAN, 3.0, 0.5, INF, 2.0, NAN, 7.0, NAN], [0, 0, 0, 1, 1, 1, 2, 2, 3]),
}


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(name, scale, case):
    rewards, gids = CASES[case]
    out = advantages(name)(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), types.SimpleNamespace(scale_rewards=scale)
    )
    exp = reference(name, rewards, gids, scale)
    assert out.dtype == torch.float32 and out.shape == (len(rewards),)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), exp, rtol=1e-6, atol=1e-6), (out, exp)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus"])
def test_edge_cases(name):
    cfg = types.SimpleNamespace(scale_rewards="group")
    # equal rewards in a group: std 0 -> 0, not NaN; a group of one -> 0
    out = advantages(name)([2.0, 2.0, 2.0, 5.0], [0, 0, 0, 1], cfg)
    assert torch.equal(out, torch.zeros(4))
    # one valid member left after NaNs -> 0; the NaN itself -> 0
    out = advantages(name)([NAN, 3.0, 1.0, 2.0], [0, 0, 1, 1], cfg)
    assert out[0] == 0 and out[1] == 0 and torch.isfinite(out).all() and out[2] < 0 < out[3]
    # everything invalid / a single sample in the batch
    assert torch.equal(advantages(name)([NAN, NAN], [0, 0], cfg), torch.zeros(2))
    for scale in ("group", "batch", "none"):
        assert torch.equal(advantages(name)([4.0], [0], types.SimpleNamespace(scale_rewards=scale)), torch.zeros(1))
    # plain lists and float32 tensors are accepted
    a = advantages(name)([0.0, 1.0], [0, 0], cfg)
    b = advantages(name)(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), cfg)
    assert torch.equal(a, b)


def test_rloo_is_leave_one_out_and_k_over_k_minus_1():
    r = [1.0, 4.0, 2.0, 7.0]
    out = advantages("rloo")(r, [0] * 4, types.SimpleNamespace(scale_rewards="none")).double()
    loo = torch.tensor([r[i] - (sum(r) - r[i]) / 3 for i in range(4)], dtype=torch.float64)
    k = torch.tensor(r, dtype=torch.float64)
    assert torch.allclose(out, loo, atol=1e-6)
    assert torch.allclose(out, (k - k.mean()) * 4 / 3, atol=1e-6)


def test_reinforce_pp_batch_whitening():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0, 5.0, 4.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    out = advantages("reinforce_plus_plus")(r, g, types.SimpleNamespace(scale_rewards="batch")).double()
    centred = torch.cat([r[:3] - r[:3].mean(), r[3:] - r[3:].mean()])
    assert abs(float(centred.mean())) < 1e-12
    assert torch.allclose(out, centred / (centred.std() + 1e-4), atol=1e-6)
    # and it differs from grpo's batch scaling (std of the raw rewards)
    grpo = advantages("grpo")(r, g, types.SimpleNamespace(scale_rewards="batch")).double()
    assert torch.allclose(grpo, centred / (r.std() + 1e-4), atol=1e-6) and not torch.allclose(grpo, out)


def test_scale_rewards_defaults_and_validation():
    r, g = [1.0, 3.0, 0.0, 4.0, 2.0, 2.5], [0, 0, 0, 1, 1, 1]
    for name, default in DEFAULT_SCALE_REWARDS.items():
        implicit = advantages(name)(r, g, types.SimpleNamespace(scale_rewards=None))
        missing = advantages(name)(r, g, types.SimpleNamespace())
        explicit = advantages(name)(r, g, types.SimpleNamespace(scale_rewards=default))
        assert torch.equal(implicit, explicit) and torch.equal(missing, explicit)
    assert DEFAULT_SCALE_REWARDS == {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
    with pytest.raises(ValueError, match="scale_rewards"):
        advantages("grpo")(r, g, types.SimpleNamespace(scale_rewards="global"))
    with pytest.raises(ValueError, match="differ in length"):
        advantages("grpo")(r, g[:-1], types.SimpleNamespace(scale_rewards="group"))


def test_valid_mask():
    m = valid_mask([1.0, NAN, -INF, 0.0, INF])
    assert m.dtype == torch.bool and m.tolist() == [True, False, False, True, False]


def test_existing_dataclass_config_works():
    from mgrpo.config import AlgorithmConfig

    out = advantages("grpo")([1.0, 2.0, 3.0], [0, 0, 0], AlgorithmConfig())
    assert torch.allclose(out.double(), torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / (1 + 1e-4), atol=1e-6)


def verl_rpp_baseline(rewards, gids, lengths):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage on per-token tensors, float64: group mean
    subtracted, the score copied to each response token, masked_whiten over all tokens (unbiased variance)."""
    scores = torch.tensor(rewards, dtype=torch.float64)
    groups = {}
    for i, g in enumerate(gids):
        groups.setdefault(g, []).append(i)
    for g, idx in groups.items():
        if len(idx) > 1:
            scores[idx] = scores[idx] - scores[idx].mean()
        else:
            scores[idx] = 0.0  # ours: no baseline, no signal (verl subtracts 0 here)
    L = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in lengths], dtype=torch.float64)
    tok = scores[:, None] * mask
    mean = (tok * mask).sum() / mask.sum()
    var = (((tok - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    white = (tok - mean) * torch.rsqrt(var + 1e-8) * mask
    return white[:, 0]


def test_reinforce_plus_plus_baseline_is_token_level_whitening():
    from mgrpo.loss.advantages import compute_advantages

    rewards = [1.0, 0.0, 0.5, 0.0, 2.0, -1.0, 0.3, 0.9]
    gids = [0, 0, 0, 0, 1, 1, 2, 2]
    lengths = [3, 12, 5, 7, 1, 20, 9, 4]
    ours = compute_advantages("reinforce_plus_plus_baseline", rewards, gids, None, lengths=lengths).double()
    ref = verl_rpp_baseline(rewards, gids, lengths)
    assert torch.allclose(ours, ref, atol=1e-6), (ours - ref).abs().max()
    # ms-swift's variant normalises over samples, not tokens: with unequal lengths the two differ
    swift = advantages("reinforce_plus_plus")(rewards, gids, types.SimpleNamespace(scale_rewards="batch")).double()
    assert (swift - ref).abs().max() > 1e-2
    # a failed (NaN) sample gets 0 and is out of the statistics
    bad = compute_advantages("reinforce_plus_plus_baseline", rewards + [NAN], gids + [2], None, lengths=lengths + [50])
    assert bad[-1] == 0 and torch.allclose(bad[:-1].double(), ref, atol=1e-6)
