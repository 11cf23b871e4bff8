"""KL estimators and rollout importance-sampling correction against float64 loop references from the formulas.

KL: k1 = d, k2 = 0.5 clamp(d, +-20)^2, k3 = clamp(exp(x) - x - 1, +-10) with x = clamp(-d, +-20), d = logp - ref_logp.
The docstring's gradient claims are checked exactly on a small categorical distribution (expectations by enumeration).
Rollout IS: rho = exp(clamp(old - rollout, +-20)); sequence ratio = geometric mean over the row's masked tokens
(seq_geomean_*, ms-swift's sequence_*) or their product exp(clamp(sum log rho, +-20)) (seq_product_*, verl's sequence).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from mgrpo.loss.kl import kl_in_reward, kl_penalty, penalize_rewards, sequence_kl
from mgrpo.loss.rollout_correction import rollout_is_weights, rollout_is_weights_from_cfg

DT = torch.float64
TOL = 1e-10


def _const(x, v):
    return x.detach() * 0 + v


def ref_kl(name, lp, rp):
    out = []
    for b in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            a, r = lp[b, t], rp[b, t]
            if name == "k1":
                v = a - r
            elif name == "k2":
                d = a - r
                if abs(float(d)) > 20:
                    d = _const(d, math.copysign(20.0, float(d)))
                v = 0.5 * d * d
            else:
                x = r - a
                if abs(float(x)) > 20:
                    x = _const(x, math.copysign(20.0, float(x)))
                v = torch.exp(x) - x - 1
                if float(v) > 10:
                    v = _const(v, 10.0)
            row.append(v)
        out.append(torch.stack(row))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(name):
    g = torch.Generator().manual_seed(0)
    logp = (-3 * torch.rand(4, 6, generator=g, dtype=DT)).requires_grad_(True)
    ref = (logp.detach() + torch.randn(4, 6, generator=g, dtype=DT)).requires_grad_(True)
    with torch.no_grad():
        ref[0, 0] = logp[0, 0] + 25  # log-ratio clamp (k2, k3)
        ref[0, 1] = logp[0, 1] - 25
        ref[1, 2] = logp[1, 2] + 4  # k3 value clamp at 10
        ref[2, 3] = logp[2, 3] - 3  # k3 small side (no clamp)
    W = torch.rand(4, 6, generator=g, dtype=DT)
    out, exp = kl_penalty(name)(logp, ref), ref_kl(name, logp, ref)
    assert torch.allclose(out, exp, atol=TOL, rtol=TOL)
    ga = torch.autograd.grad((W * out).sum(), (logp, ref))
    ge = torch.autograd.grad((W * exp).sum(), (logp, ref))
    for a, b in zip(ga, ge):
        assert torch.allclose(a, b, atol=TOL, rtol=TOL)
    if name != "k1":
        assert ga[0][0, 0] == 0 and ga[0][0, 1] == 0  # clamped: no gradient
    if name == "k3":
        assert out[1, 2] == 10 and ga[0][1, 2] == 0 and (out >= 0).all()


def test_kl_aliases_and_unknown():
    assert kl_penalty("low_var_kl") is kl_penalty("k3") and kl_penalty("mse") is kl_penalty("k2")
    assert kl_penalty("kl") is kl_penalty("k1")
    with pytest.raises(KeyError, match="known"):
        kl_penalty("k4")


def test_kl_gradient_claims_exact_on_a_categorical():
    """E_pi[grad k1] = 0; E_pi[grad k2] = grad KL(pi||ref); E_pi[grad k3] = grad KL(ref||pi) (not KL(pi||ref));
    and k1, k3 are unbiased for the value KL(pi||ref) while k2 is not."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=g, dtype=DT, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(6, generator=g, dtype=DT), 0)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()

    def expected_grad(name):
        per_sample = kl_penalty(name)(logp, ref_logp)  # one "token" per outcome y
        return torch.autograd.grad((pi * per_sample).sum(), theta, retain_graph=True)[0], (pi * per_sample).sum()

    reverse = (logp.exp() * (logp - ref_logp)).sum()
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()
    g_rev = torch.autograd.grad(reverse, theta, retain_graph=True)[0]
    g_fwd = torch.autograd.grad(forward, theta, retain_graph=True)[0]
    g1, v1 = expected_grad("k1")
    g2, v2 = expected_grad("k2")
    g3, v3 = expected_grad("k3")
    assert torch.allclose(g1, torch.zeros(6, dtype=DT), atol=1e-12)
    assert torch.allclose(g2, g_rev, atol=1e-12)
    assert torch.allclose(g3, g_fwd, atol=1e-12) and not torch.allclose(g3, g_rev, atol=1e-3)
    assert float(v1) == pytest.approx(float(reverse), abs=1e-12)
    assert float(v3) == pytest.approx(float(reverse), abs=1e-12)
    assert abs(float(v2) - float(reverse)) > 1e-4


def test_kl_in_reward_and_sequence_kl():
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 5, generator=g, dtype=DT)).requires_grad_(True)
    ref = -torch.rand(3, 5, generator=g, dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=DT)
    ref_pad = ref.clone()
    ref_pad[mask == 0] = float("nan")
    k = kl_in_reward(logp, ref_pad, mask)
    assert not k.requires_grad and torch.isfinite(k).all()
    for b in range(3):
        for t in range(5):
            assert float(k[b, t]) == (float(logp[b, t] - ref[b, t]) if mask[b, t] else 0.0)
    seq = sequence_kl(logp, ref_pad, mask)
    exp = [sum(float(logp[b, t] - ref[b, t]) for t in range(5) if mask[b, t]) for b in range(3)]
    assert torch.allclose(seq, torch.tensor(exp, dtype=DT), atol=TOL)
    calls = []
    split = sequence_kl(logp, ref_pad, mask, seq_sum=lambda x: calls.append(1) or x[:, :2].sum(-1) + x[:, 2:].sum(-1))
    assert calls and torch.allclose(split, seq, atol=TOL)
    rewards = torch.tensor([1.0, float("nan"), 0.5], dtype=DT)
    pen = penalize_rewards(rewards, seq, 0.1)
    assert pen[0] == pytest.approx(1.0 - 0.1 * exp[0]) and math.isnan(pen[1]) and pen[2] == 0.5


# ------------------------------------------------------------------------------------ rollout correction
def ref_weights(old, roll, mask, mode, C, lower=None):
    B, L = old.shape
    W = torch.zeros(B, L, dtype=DT)
    changed = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        toks = [t for t in range(L) if mask[b, t] > 0]
        lr = {t: max(-20.0, min(20.0, float(old[b, t] - roll[b, t]))) for t in toks}
        if mode.startswith("seq_product"):
            seq = math.exp(max(-20.0, min(20.0, sum(lr.values())))) if toks else 1.0
        else:
            seq = math.exp(sum(lr.values()) / len(toks)) if toks else 1.0
        for t in toks:
            rho = math.exp(lr[t])
            basis = seq if mode.startswith(("sequence", "seq_")) else rho
            if mode.endswith("truncate"):
                W[b, t] = min(basis, C)
                changed[b, t] = basis > C
            else:
                keep = basis <= C and (lower is None or basis >= lower)
                W[b, t] = rho if keep else 0.0
                changed[b, t] = not keep
    return W, changed


def _batch(seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(5, 8, generator=g, dtype=DT)
    roll = old + spread * torch.randn(5, 8, generator=g, dtype=DT)
    roll[0, 0] = old[0, 0] - 30  # beyond the +-20 safety clamp
    mask = torch.zeros(5, 8, dtype=DT)
    for b, n in enumerate([8, 5, 0, 3, 7]):
        mask[b, :n] = 1
    roll_pad = roll.clone()
    roll_pad[mask == 0] = float("nan")
    return old, roll, roll_pad, mask


MODES = [
    "token_truncate",
    "token_mask",
    "seq_geomean_truncate",
    "seq_geomean_mask",
    "seq_product_truncate",
    "seq_product_mask",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lower", [None, 0.5])
def test_rollout_weights_match_reference(mode, lower):
    old, roll, roll_pad, mask = _batch(seed=1, spread=0.6)
    old_g = old.clone().requires_grad_(True)
    w, m = rollout_is_weights(old_g, roll_pad, mask, mode, threshold=1.5, lower=lower)
    exp, changed = ref_weights(old, roll, mask, mode, 1.5, lower if mode.endswith("mask") else None)
    assert not w.requires_grad and torch.isfinite(w).all()
    assert torch.allclose(w, exp, atol=TOL, rtol=TOL)
    on = mask > 0
    key = "rollout_is_clip_frac" if mode.endswith("truncate") else "rollout_is_mask_frac"
    assert float(m[key]) == pytest.approx(float(changed[on].double().mean()))
    assert 0 < float(m[key]) < 1
    lr = (old - roll).clamp(-20, 20)[on]
    assert float(m["rollout_logp_abs_diff"]) == pytest.approx(float(lr.abs().mean()))
    assert float(m["rollout_kl_k1"]) == pytest.approx(float((-lr).mean()))
    assert float(m["rollout_kl_k3"]) == pytest.approx(float((lr.exp() - 1 - lr).mean()))
    assert float(m["rollout_is_weight_mean"]) == pytest.approx(float(exp[on].mean()))
    assert all(v.dim() == 0 and torch.isfinite(v) for v in m.values())


def test_sequence_ratio_is_geometric_mean_and_aliases():
    old = torch.zeros(1, 4, dtype=DT)
    roll = torch.log(torch.tensor([[1 / 3, 1 / 3, 1 / 3, 1.0]], dtype=DT))  # rho = 3, 3, 3, 1
    mask = torch.tensor([[1, 1, 0, 0]], dtype=DT)
    w, _ = rollout_is_weights(old, roll, mask, "sequence_truncate", threshold=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 0, 0]], dtype=DT))  # geo mean 3 -> 2, not 9
    w2, _ = rollout_is_weights(old, roll, mask, "sequence_mask", threshold=4.0)
    assert torch.allclose(w2, torch.tensor([[3.0, 3.0, 0, 0]], dtype=DT))  # kept: token ratios
    for alias, mode in [
        ("tis", "token_truncate"),
        ("mis", "token_mask"),
        ("seq_tis", "sequence_truncate"),
        ("seq_mis", "sequence_mask"),
    ]:
        a, _ = rollout_is_weights(old, roll, mask, alias)
        b, _ = rollout_is_weights(old, roll, mask, mode)
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="mode"):
        rollout_is_weights(old, roll, mask, "sequence_clip")
    with pytest.raises(ValueError, match="lower"):
        rollout_is_weights(old, roll, mask, "token_mask", threshold=2.0, lower=3.0)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_rollout_seq_sum_hook(mode):
    old, roll, _, mask = _batch(seed=2, spread=0.5)
    base, _ = rollout_is_weights(old, roll, mask, mode, threshold=1.2)
    calls = []
    split, _ = rollout_is_weights(
        old, roll, mask, mode, threshold=1.2, seq_sum=lambda x: calls.append(1) or x[:, :3].sum(-1) + x[:, 3:].sum(-1)
    )
    assert len(calls) == 2 and torch.allclose(split, base, atol=TOL)
    wrong, _ = rollout_is_weights(old, roll, mask, mode, threshold=1.2, seq_sum=lambda x: x[:, :3].sum(-1))
    assert not torch.allclose(wrong, base)
    # CP simulation: each rank owns a column slice; seq_sum adds the other ranks' partial sums
    cols = [slice(0, 3), slice(3, 8)]
    partials = []
    for s in cols:
        rec = []
        rollout_is_weights(
            old[:, s],
            roll[:, s],
            mask[:, s],
            mode,
            threshold=1.2,
            seq_sum=lambda x, rec=rec: rec.append(x.sum(-1)) or rec[-1],
        )
        partials.append(rec)
    parts = []
    for k, s in enumerate(cols):
        it = iter(range(100))
        parts.append(
            rollout_is_weights(
                old[:, s],
                roll[:, s],
                mask[:, s],
                mode,
                threshold=1.2,
                seq_sum=lambda x, k=k, it=it: (lambda i: x.sum(-1) + partials[1 - k][i])(next(it)),
            )[0]
        )
    assert torch.allclose(torch.cat(parts, 1), base, atol=TOL)


def test_rollout_from_cfg():
    old, roll, _, mask = _batch(seed=4, spread=0.3)
    w, m = rollout_is_weights_from_cfg(old, roll, mask, types.SimpleNamespace())
    assert w is None and "rollout_kl_k3" in m and "rollout_is_weight_mean" not in m
    assert rollout_is_weights_from_cfg(old, None, mask, types.SimpleNamespace(rollout_is_mode="tis")) == (None, {})
    cfg = types.SimpleNamespace(rollout_is_mode="token_mask", rollout_is_threshold=1.3, rollout_is_lower=0.7)
    w, m = rollout_is_weights_from_cfg(old, roll, mask, cfg)
    exp, _ = ref_weights(old, roll, mask, "token_mask", 1.3, 0.7)
    assert torch.allclose(w, exp, atol=TOL) and "rollout_is_mask_frac" in m
    # the weights plug into a policy loss as rollout_is_weights (multiplying the per-token loss)
    from mgrpo.loss.registry import policy_loss

    logp = old.clone().requires_grad_(True)
    adv = torch.randn(5, dtype=DT, generator=torch.Generator().manual_seed(0))
    pcfg = types.SimpleNamespace(epsilon_low=0.2, epsilon_high=0.2)
    plain, _ = policy_loss("ppo_clip")(logp, old, adv, mask, pcfg)
    weighted, _ = policy_loss("ppo_clip")(logp, old, adv, mask, pcfg, rollout_is_weights=w)
    assert torch.allclose(weighted, plain * w, atol=TOL)


def test_rollout_empty_mask():
    old, roll, roll_pad, _ = _batch()
    empty = torch.zeros_like(old)
    for mode in MODES:
        w, m = rollout_is_weights(old, roll_pad, empty, mode)
        assert (w == 0).all() and all(torch.isfinite(v) for v in m.values())


def test_sequence_product_is_the_likelihood_ratio_and_geomean_is_not():
    old = torch.zeros(1, 4, dtype=DT)
    roll = torch.log(torch.tensor([[1 / 3, 1 / 3, 1 / 3, 1.0]], dtype=DT))  # rho = 3, 3, 3, 1
    mask = torch.tensor([[1, 1, 0, 0]], dtype=DT)
    prod, _ = rollout_is_weights(old, roll, mask, "seq_product_truncate", threshold=100.0)
    geo, _ = rollout_is_weights(old, roll, mask, "seq_geomean_truncate", threshold=100.0)
    assert torch.allclose(prod, torch.tensor([[9.0, 9.0, 0, 0]], dtype=DT))  # 3 x 3: the sequence's ratio
    assert torch.allclose(geo, torch.tensor([[3.0, 3.0, 0, 0]], dtype=DT))  # sqrt(3 x 3)
    keep, _ = rollout_is_weights(old, roll, mask, "seq_product_mask", threshold=8.0)
    assert (keep == 0).all(), "the product 9 is above 8: the sequence is dropped (the geometric mean 3 would stay)"
    for swift_name, ours in [("sequence_truncate", "seq_geomean_truncate"), ("sequence_mask", "seq_geomean_mask")]:
        assert torch.equal(
            rollout_is_weights(old, roll, mask, swift_name)[0], rollout_is_weights(old, roll, mask, ours)[0]
        )
    long_old = torch.zeros(1, 50, dtype=DT)  # 50 tokens of ratio e: the product is clamped at e^20
    w, _ = rollout_is_weights(
        long_old, long_old - 1.0, torch.ones(1, 50, dtype=DT), "seq_product_truncate", threshold=1e12
    )
    assert torch.allclose(w, torch.full((1, 50), math.exp(20.0), dtype=DT))


@pytest.mark.parametrize("mode", MODES)
def test_samples_without_rollout_logprobs_are_left_out(mode):
    """Row 1 has no rollout logprobs (the micro-batch holds zeros there): weight 1, not exp(old - 0), and out of
    the metrics, which equal those of the batch without that row."""
    old, roll, _, mask = _batch(seed=5, spread=0.4)
    roll[1] = 0.0
    has = mask.clone()
    has[1] = 0
    w, m = rollout_is_weights(old, roll, mask, mode, threshold=1.5, has_rollout=has)
    assert torch.equal(w[1], mask[1]), "no correction for the row without logprobs"
    keep = [0, 2, 3, 4]
    w_ref, m_ref = rollout_is_weights(old[keep], roll[keep], mask[keep], mode, threshold=1.5)
    assert torch.allclose(w[keep], w_ref, atol=TOL)
    for k in m:
        assert float(m[k]) == pytest.approx(float(m_ref[k]), abs=1e-12), k
    # negative control: the zeros read as logprobs give exp(old - 0) < 1 ratios and other metrics
    w_bad, m_bad = rollout_is_weights(old, roll, mask, mode, threshold=1.5)
    assert not torch.equal(w_bad[1], mask[1]) or float(m_bad["rollout_logp_abs_diff"]) != pytest.approx(
        float(m_ref["rollout_logp_abs_diff"])
    )
    assert float(m_bad["rollout_logp_abs_diff"]) != pytest.approx(float(m_ref["rollout_logp_abs_diff"]))


def test_microbatches_mark_samples_without_rollout_logprobs():
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.rollout.types import Sample

    with_lp = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], loss_mask=[1, 1], rollout_logprobs=[-0.5, -0.25])
    without = Sample(prompt_ids=[1, 2], response_ids=[6, 7, 8], loss_mask=[1, 0, 1], rollout_logprobs=None)
    mb = make_microbatches([with_lp, without], 2, 0)[0]
    assert mb["has_rollout"][0].tolist() == [0, 0, 1, 1, 0] and mb["has_rollout"][1].tolist() == [0] * 5
    assert mb["loss_mask"][1].tolist() == [0, 1, 0, 1, 0], "the sample still trains, only without IS correction"
    assert mb["rollout_logp"][0, 2:4].tolist() == [-0.5, -0.25]
