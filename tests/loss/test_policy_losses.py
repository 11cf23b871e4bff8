"""Policy losses and presets against plain float64 reimplementations written here from the formulas.

The references loop over rows and tokens with scalar autograd ops (no code shared with mgrpo.loss.policy); values
are compared per token and gradients of ``sum(W * per_token_loss)`` (random W) w.r.t. ``logp``, both at 1e-10.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from mgrpo.config import AlgorithmConfig
from mgrpo.loss.policy import DEFAULT_EPSILONS
from mgrpo.loss.presets import PRESETS, aggregate_reference, apply_preset, resolve_preset
from mgrpo.loss.registry import advantages as advantage_fn
from mgrpo.loss.registry import policy_loss

TOL = 1e-10
DT = torch.float64


def cfg_of(**kw):
    base = dict(
        epsilon_low=0.2,
        epsilon_high=0.28,
        kl_coef=0.0,
        clip_ratio_c=3.0,
        kl_in_reward=False,
        kl_estimator="k3",
        scale_rewards="group",
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def make_batch(seed=0, B=5, L=7, spread=0.3, per_token_adv=True):
    """Rows of different lengths, one empty row (index 2); log ratios up to ~+-5 when spread is large."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g, dtype=DT) * 3).requires_grad_(True)
    old = logp.detach() + spread * torch.randn(B, L, generator=g, dtype=DT)
    ref = logp.detach() + 0.5 * torch.randn(B, L, generator=g, dtype=DT)
    lengths = [L, L - 2, 0, 3, L - 1][:B]
    mask = torch.zeros(B, L, dtype=DT)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    adv_row = torch.randn(B, generator=g, dtype=DT)
    adv = adv_row[:, None].expand(B, L) * mask if per_token_adv else adv_row
    W = torch.rand(B, L, generator=g, dtype=DT) + 0.5
    return logp, old, ref, adv, mask, W


# ----------------------------------------------------------------------------------------------- references
def _a(adv, b, t):
    return float(adv[b, t]) if adv.dim() == 2 else float(adv[b])


def _surrogate(r, a, lo, hi, c):
    """-min(r a, clip(r) a), dual-clipped at -a c for a < 0; r a scalar tensor."""
    un = -a * r
    rc = r
    if float(r) < 1 - lo:
        rc = r.detach() * 0 + (1 - lo)
    elif float(r) > 1 + hi:
        rc = r.detach() * 0 + (1 + hi)
    cl = -a * rc
    v = un if float(un) >= float(cl) else cl
    if c is not None and a < 0 and float(v) > -a * c:
        v = r.detach() * 0 + (-a * c)
    return v


def _k3(lp, rp):
    x = rp - lp
    if abs(float(x)) > 20:
        x = x.detach().clamp(-20, 20)
    v = torch.exp(x) - x - 1
    if float(v) > 10:
        v = v.detach() * 0 + 10
    return v


def _k2(lp, rp):
    d = lp - rp
    if abs(float(d)) > 20:
        d = d.detach().clamp(-20, 20)
    return 0.5 * d * d


def _extras(v, b, t, logp, ref, cfg, w):
    """verl's order: the rollout IS weight multiplies the policy term only, the KL term is added unweighted."""
    if w is not None:
        v = v * float(w[b, t])
    if ref is not None and cfg.kl_coef and not cfg.kl_in_reward:
        k = {"k3": _k3, "k2": _k2, "k1": lambda x, y: x - y}[cfg.kl_estimator]
        v = v + cfg.kl_coef * k(logp[b, t], ref[b, t])
    return v


def ref_loss(name, logp, old, adv, mask, cfg, ref=None, w=None):
    B, L = logp.shape
    lo = cfg.epsilon_low if cfg.epsilon_low is not None else DEFAULT_EPSILONS[name][0]
    hi = cfg.epsilon_high if cfg.epsilon_high is not None else DEFAULT_EPSILONS[name][1]
    c = cfg.clip_ratio_c
    rows = []
    for b in range(B):
        toks = [t for t in range(L) if mask[b, t] > 0]
        if name in ("gspo", "gspo_token") and toks:
            s = sum(logp[b, t] - old[b, t] for t in toks) / len(toks)
        row = []
        for t in range(L):
            if mask[b, t] == 0:
                row.append(torch.zeros((), dtype=DT))
                continue
            a = _a(adv, b, t)
            if name == "ppo_clip":
                v = _surrogate(torch.exp(logp[b, t] - old[b, t]), a, lo, hi, c)
            elif name == "gspo":
                v = _surrogate(torch.exp(s), a, lo, hi, c)
            elif name == "gspo_token":
                r = torch.exp(s.detach()) * torch.exp(logp[b, t]) / torch.exp(logp[b, t]).detach()
                v = _surrogate(r, a, lo, hi, c)
            elif name == "cispo":
                r = math.exp(float(logp[b, t] - old[b, t]))
                v = -min(r, hi) * a * logp[b, t]
            elif name == "sapo":  # the paper's eq.: f(r) = sigmoid(tau (r - 1)) 4 / tau, loss -f(r) A
                x = logp[b, t] - old[b, t]
                if abs(float(x)) > 20:
                    x = x.detach().clamp(-20, 20)
                tau = cfg.tau_pos if a > 0 else cfg.tau_neg
                v = -(1 / (1 + torch.exp(-tau * (torch.exp(x) - 1)))) * (4 / tau) * a
            row.append(_extras(v, b, t, logp, ref, cfg, w))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def check(actual, expected, logp, W):
    assert torch.isfinite(actual).all()
    assert torch.allclose(actual, expected, atol=TOL, rtol=TOL), (actual - expected).abs().max()
    ga, ge = (
        torch.autograd.grad((W * x).sum(), logp, retain_graph=True, allow_unused=True)[0] if x.requires_grad else None
        for x in (actual, expected)
    )
    ga, ge = (torch.zeros_like(logp) if g is None else g for g in (ga, ge))
    assert torch.isfinite(ga).all()
    assert torch.allclose(ga, ge, atol=TOL, rtol=TOL), (ga - ge).abs().max()
    return ga


NAMES = ["ppo_clip", "gspo", "gspo_token", "cispo", "sapo"]


def _cfg_for(name, **kw):
    if name == "cispo":
        return cfg_of(**{"epsilon_low": None, "epsilon_high": 5.0, **kw})
    if name.startswith("gspo"):
        return cfg_of(**{"epsilon_low": 3e-4, "epsilon_high": 4e-4, **kw})
    if name == "sapo":  # not the defaults, so a swapped or ignored temperature shows
        return cfg_of(**{"tau_pos": 0.8, "tau_neg": 1.6, **kw})
    return cfg_of(**kw)


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("spread", [0.05, 2.5])
@pytest.mark.parametrize("per_token_adv", [True, False])
def test_loss_matches_reference(name, spread, per_token_adv):
    logp, old, ref, adv, mask, W = make_batch(
        seed=int(spread * 10) + len(name), spread=spread, per_token_adv=per_token_adv
    )
    cfg = _cfg_for(name)
    out, metrics = policy_loss(name)(logp, old, adv, mask, cfg)
    ga = check(out, ref_loss(name, logp, old, adv, mask, cfg), logp, W)
    assert (out[mask == 0] == 0).all() and (ga[mask == 0] == 0).all()
    for v in metrics.values():
        assert v.dim() == 0 and not v.requires_grad and torch.isfinite(v)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("estimator", ["k3", "k2", "k1"])
def test_kl_term_and_rollout_weights(name, estimator):
    logp, old, ref, adv, mask, W = make_batch(seed=3, spread=0.4)
    ref = ref.clone()
    ref[0, 1] = logp[0, 1].detach() + 25.0  # log-ratio clamp and k3 clamp active
    ref[1, 0] = logp[1, 0].detach() - 4.0  # k3 clamp at 10 active
    w = torch.rand(logp.shape, dtype=DT, generator=torch.Generator().manual_seed(1)) * 2
    cfg = _cfg_for(name, kl_coef=0.07, kl_estimator=estimator)
    out, m = policy_loss(name)(logp, old, adv, mask, cfg, ref_logp=ref, rollout_is_weights=w)
    check(out, ref_loss(name, logp, old, adv, mask, cfg, ref=ref, w=w), logp, W)
    assert "kl" in m
    # the IS weights leave the KL term alone: the loss with weights minus the loss without them is exactly the
    # policy term times (w - 1), which is what verl's pg_losses * rollout_is_weights + kl_loss * coef gives
    unweighted, _ = policy_loss(name)(logp, old, adv, mask, cfg, ref_logp=ref)
    policy_only, _ = policy_loss(name)(logp, old, adv, mask, _cfg_for(name))
    assert torch.allclose(out - unweighted, policy_only * (w - 1) * mask, atol=1e-12)
    # kl_in_reward switches the loss term off; kl_coef 0 too
    for c in (_cfg_for(name, kl_coef=0.07, kl_in_reward=True), _cfg_for(name, kl_coef=0.0)):
        plain, m2 = policy_loss(name)(logp, old, adv, mask, c, ref_logp=ref)
        check(plain, ref_loss(name, logp, old, adv, mask, c), logp, W)
        assert "kl" not in m2


def test_dual_clip_active_for_negative_advantages():
    logp, old, _, adv, mask, W = make_batch(seed=5, spread=0.1)
    old = old.clone()
    old[0, :] = logp[0].detach() - 5.0  # ratio e^5 ~ 148 > clip_ratio_c
    old[1, :] = logp[1].detach() + 5.0  # ratio e^-5
    adv = adv.clone()
    adv[0] = -1.3 * mask[0]
    adv[1] = 0.7 * mask[1]
    cfg = cfg_of()
    out, m = policy_loss("ppo_clip")(logp, old, adv, mask, cfg)
    ga = check(out, ref_loss("ppo_clip", logp, old, adv, mask, cfg), logp, W)
    assert torch.allclose(out[0], 1.3 * 3.0 * mask[0])  # capped at -A * c
    assert (ga[0] == 0).all()
    n = mask.sum()
    assert m["dual_clip_frac"] == pytest.approx(float(mask[0].sum() / n))
    # without the dual clip the loss is -A r (unbounded)
    out_nc, m_nc = policy_loss("ppo_clip")(logp, old, adv, mask, cfg_of(clip_ratio_c=None))
    check(out_nc, ref_loss("ppo_clip", logp, old, adv, mask, cfg_of(clip_ratio_c=None)), logp, W)
    assert out_nc[0, 0] > 100 and "dual_clip_frac" not in m_nc
    # row 1 (A > 0, ratio far below 1 - eps) is not clipped: gradient -A r flows
    assert (ga[1][mask[1] > 0] != 0).all()
    # the default (attribute missing, or the config's default None) is no dual clip, as ms-swift
    bare = types.SimpleNamespace(epsilon_low=0.2, epsilon_high=0.28)
    out_d, m_d = policy_loss("ppo_clip")(logp, old, adv, mask, bare)
    assert torch.equal(out_d, out_nc) and "dual_clip_frac" not in m_d
    from mgrpo.config import AlgorithmConfig

    assert AlgorithmConfig().clip_ratio_c is None


def test_metrics_are_masked_means():
    logp, old, _, adv, mask, _ = make_batch(seed=11, spread=1.0)
    cfg = cfg_of(clip_ratio_c=None)
    _, m = policy_loss("ppo_clip")(logp, old, adv, mask, cfg)
    on = mask > 0
    r = torch.exp(logp.detach() - old)
    hi = ((r > 1.28) & (adv > 0) & on).sum() / on.sum()
    lo = ((r < 0.8) & (adv < 0) & on).sum() / on.sum()
    assert m["clip_frac_high"] == pytest.approx(float(hi)) and m["clip_frac_low"] == pytest.approx(float(lo))
    assert m["clip_frac"] == pytest.approx(float(hi + lo))
    assert m["approx_kl"] == pytest.approx(float((0.5 * (logp.detach() - old) ** 2)[on].mean()))


@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_and_empty_rows(name):
    """NaN / -inf off the mask never reach values or gradients; an all-empty batch gives zeros."""
    logp0, old, ref, adv, mask, W = make_batch(seed=7, spread=0.5)
    logp_data = logp0.detach().clone()
    logp_data[mask == 0] = float("nan")
    logp = logp_data.requires_grad_(True)
    old = old.clone()
    old[mask == 0] = float("-inf")
    ref = ref.clone()
    ref[mask == 0] = float("nan")
    adv = adv.clone()
    adv[mask == 0] = float("nan")
    w = torch.ones_like(mask)
    w[mask == 0] = float("nan")
    cfg = _cfg_for(name, kl_coef=0.1)
    out, m = policy_loss(name)(logp, old, adv, mask, cfg, ref_logp=ref, rollout_is_weights=w)
    (g,) = torch.autograd.grad((W * out).sum(), logp)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    assert (out[mask == 0] == 0).all() and (g[mask == 0] == 0).all()
    assert all(torch.isfinite(v) for v in m.values())
    clean, _ = policy_loss(name)(
        logp0,
        torch.where(mask > 0, old, 0),
        torch.where(mask > 0, adv, 0),
        mask,
        cfg,
        ref_logp=torch.where(mask > 0, ref, 0),
    )
    assert torch.allclose(out, clean, atol=TOL, rtol=TOL)
    empty = torch.zeros_like(mask)
    out_e, m_e = policy_loss(name)(logp0, old, adv, empty, cfg, ref_logp=ref)
    (g_e,) = torch.autograd.grad(out_e.sum(), logp0)
    assert (out_e == 0).all() and (g_e == 0).all() and all(torch.isfinite(v) for v in m_e.values())


# ------------------------------------------------------------------------------------------ seq_sum hook
def _split_sum(x):
    h = x.shape[-1] // 2
    return x[..., :h].sum(-1) + x[..., h:].sum(-1)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_seq_sum_hook_is_used(name):
    logp, old, _, adv, mask, W = make_batch(seed=13, spread=0.01)
    cfg = _cfg_for(name, epsilon_low=0.2, epsilon_high=0.2)
    base, _ = policy_loss(name)(logp, old, adv, mask, cfg)
    calls = []

    def spy(x):
        calls.append(tuple(x.shape))
        return _split_sum(x)

    split, _ = policy_loss(name)(logp, old, adv, mask, cfg, seq_sum=spy)
    assert calls and all(c == (logp.shape[0],) + logp.shape[1:] for c in calls)
    check(split, base, logp, W)
    wrong, _ = policy_loss(name)(logp, old, adv, mask, cfg, seq_sum=lambda x: x[..., : x.shape[-1] // 2].sum(-1))
    assert not torch.allclose(wrong, base)


@pytest.mark.parametrize("name", NAMES)
def test_context_parallel_simulation(name):
    """Each 'CP rank' sees a column slice; its seq_sum adds the other ranks' partial sums (kept in the graph, as a
    differentiable all-reduce does). The per-token losses and the gradient of the summed loss equal the unsplit ones."""
    logp, old, ref, adv, mask, W = make_batch(seed=17, spread=0.02)
    cfg = _cfg_for(name, kl_coef=0.05) if name != "gspo" else _cfg_for(name, epsilon_low=0.2, epsilon_high=0.2)
    full, _ = policy_loss(name)(logp, old, adv, mask, cfg, ref_logp=ref)
    cols = [slice(0, 3), slice(3, 5), slice(5, None)]
    fn = policy_loss(name)

    def run(k, seq_sum):
        s = cols[k]
        return fn(logp[:, s], old[:, s], adv[:, s], mask[:, s], cfg, ref_logp=ref[:, s], seq_sum=seq_sum)[0]

    partials = []
    for k in range(len(cols)):
        rec = []
        run(k, lambda x, rec=rec: rec.append(x.sum(-1)) or rec[-1])
        partials.append(rec)
    outs = []
    for k in range(len(cols)):
        it = iter(range(10**6))

        def allreduce(x, k=k, it=it):
            i = next(it)
            return x.sum(-1) + sum(partials[j][i] for j in range(len(cols)) if j != k)

        outs.append(run(k, allreduce))
    check(torch.cat(outs, dim=1), full, logp, W)


# ------------------------------------------------------------------------------------------------ epsilons
def test_default_epsilons_by_loss():
    logp, old, _, adv, mask, _ = make_batch(seed=19, spread=0.01)
    for name, (lo, hi) in DEFAULT_EPSILONS.items():
        implicit, _ = policy_loss(name)(logp, old, adv, mask, cfg_of(epsilon_low=None, epsilon_high=None))
        explicit, _ = policy_loss(name)(logp, old, adv, mask, cfg_of(epsilon_low=lo, epsilon_high=hi))
        assert torch.equal(implicit, explicit)
    assert DEFAULT_EPSILONS["gspo"] == (3e-4, 4e-4) and DEFAULT_EPSILONS["cispo"][1] == 5.0
    with pytest.raises(ValueError, match="absolute cap"):
        policy_loss("cispo")(logp, old, adv, mask, cfg_of(epsilon_high=0.2))


def test_cispo_keeps_gradient_beyond_the_cap():
    logp, old, _, adv, mask, W = make_batch(seed=23, spread=0.1)
    old = old.clone()
    old[0] = logp[0].detach() - 4.0  # ratio e^4 > 5: weight capped at 5, gradient still -5 A
    cfg = _cfg_for("cispo")
    out, m = policy_loss("cispo")(logp, old, adv, mask, cfg)
    g = check(out, ref_loss("cispo", logp, old, adv, mask, cfg), logp, W)
    on0 = mask[0] > 0
    assert torch.allclose(g[0][on0], -(W[0] * 5.0 * adv[0])[on0], atol=TOL)
    assert m["clip_frac"] > 0


# ------------------------------------------------------------------------------------------------- presets
def _swift_reference(preset_name, logp, old, rewards, gids, mask, max_len):
    """ms-swift's loss for loss_type=preset_name on one batch, written from the walkthrough (float64 loops)."""
    # advantages (scale_rewards per the preset) -----------------------------------------------------------
    scale = {"grpo": "group", "bnpo": "group", "dr_grpo": "none", "dapo": "group", "cispo": "group", "sapo": "group"}[
        preset_name
    ]
    groups = {}
    for i, g in enumerate(gids.tolist()):
        groups.setdefault(g, []).append(float(rewards[i]))
    A = []
    for i, g in enumerate(gids.tolist()):
        rs = groups[g]
        mu = sum(rs) / len(rs)
        sd = math.sqrt(sum((x - mu) ** 2 for x in rs) / (len(rs) - 1))
        a = float(rewards[i]) - mu
        A.append(a / (sd + 1e-4) if scale == "group" else a)
    lo, hi = {"dapo": (0.2, 0.28), "cispo": (None, 5.0)}.get(preset_name, (0.2, 0.2))
    B, L = logp.shape
    per = [[None] * L for _ in range(B)]
    for b in range(B):
        for t in range(L):
            r = torch.exp(logp[b, t] - old[b, t])
            if preset_name == "cispo":
                per[b][t] = -min(float(r), hi) * A[b] * logp[b, t]
            elif preset_name == "sapo":  # ms-swift's SAPO page: -sigmoid(tau (r - 1)) 4/tau A, tau 1.0 / 1.05
                tau = 1.0 if A[b] > 0 else 1.05
                per[b][t] = -torch.sigmoid(tau * (r - 1)) * (4 / tau) * A[b]
            else:  # -min(r A, clip(r) A), no dual clip in ms-swift
                rc = r
                if float(r) < 1 - lo:
                    rc = r.detach() * 0 + (1 - lo)
                elif float(r) > 1 + hi:
                    rc = r.detach() * 0 + (1 + hi)
                per[b][t] = -torch.minimum(r * A[b], rc * A[b])
    tok = [[per[b][t] * mask[b, t] for t in range(L)] for b in range(B)]
    if preset_name in ("grpo", "sapo"):  # ms-swift L1240
        return sum(sum(tok[b]) / max(float(mask[b].sum()), 1.0) for b in range(B)) / B
    if preset_name == "dr_grpo":
        return sum(sum(r) for r in tok) / (B * max_len)
    return sum(sum(r) for r in tok) / max(float(mask.sum()), 1.0)  # bnpo (whole batch), dapo, cispo


@pytest.mark.parametrize("preset_name", sorted(PRESETS))
def test_presets_match_ms_swift_formulas(preset_name):
    logp, old, _, _, mask, _ = make_batch(seed=29, B=6, L=5, spread=0.4)
    mask = mask.clone()
    mask[:, 0] = 1  # no empty row: ms-swift's per-process formulas and ours agree on one batch
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0], dtype=DT)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    base = dataclasses.replace(AlgorithmConfig(), kl_coef=0.0)
    cfg = apply_preset(base, preset_name)
    p = resolve_preset(preset_name)
    assert (cfg.policy_loss, cfg.aggregation, cfg.scale_rewards) == (p.policy_loss, p.aggregation, p.scale_rewards)
    # ms-swift has no dual clip by default (delta=None): switch ours off
    ns = types.SimpleNamespace(**{**dataclasses.asdict(cfg), "clip_ratio_c": None})
    adv = advantage_fn("grpo")(rewards, gids, ns).to(DT)
    per_token, _ = policy_loss(ns.policy_loss)(logp, old, adv[:, None] * mask, mask, ns)
    ours = aggregate_reference(per_token, mask, ns.aggregation, max_len=8)
    theirs = _swift_reference(preset_name, logp, old, rewards, gids, mask, max_len=8)
    # advantages come back in float32 by contract: values agree to float32 rounding of A
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6, abs=1e-7)
    (g1,) = torch.autograd.grad(ours, logp)
    (g2,) = torch.autograd.grad(theirs, logp)
    assert torch.allclose(g1, g2, rtol=1e-6, atol=1e-7)


def test_preset_table_and_unknown():
    assert PRESETS["grpo"].aggregation == "seq-mean-token-mean"
    assert PRESETS["bnpo"].aggregation == "token-mean"
    assert PRESETS["dr_grpo"].aggregation == "seq-mean-token-sum-norm" and PRESETS["dr_grpo"].scale_rewards == "none"
    assert (PRESETS["dapo"].epsilon_low, PRESETS["dapo"].epsilon_high) == (0.2, 0.28)
    assert all(p.policy_loss in DEFAULT_EPSILONS for p in PRESETS.values())
    with pytest.raises(KeyError, match="known"):
        resolve_preset("nope")
    ns = apply_preset(
        types.SimpleNamespace(policy_loss="x", aggregation="y", scale_rewards="z", epsilon_low=0.1, epsilon_high=0.1),
        "dr_grpo",
    )
    assert (ns.epsilon_low, ns.epsilon_high, ns.aggregation) == (0.1, 0.1, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("name", NAMES)
def test_huge_ratio_with_zero_advantage_gives_no_nan(name):
    """log ratio 800 (old logprob -800): exp overflows to inf and 0 x inf = NaN without the +-20 clamp."""
    logp, old, ref, adv, mask, W = make_batch(seed=3)
    old = old.clone()
    old[0, :] = -800.0
    adv = adv.clone()
    adv[0] = 0.0
    out, metrics = policy_loss(name)(logp, old, adv, mask, _cfg_for(name, clip_ratio_c=None))
    grad = torch.autograd.grad((W * out).sum(), logp)[0]
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert (out[0] == 0).all(), "advantage 0: no loss, whatever the ratio"
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.isnan(torch.tensor(0.0) * torch.exp(torch.tensor(800.0))), "the hazard the clamp removes"


def test_cispo_clip_frac_counts_every_capped_token():
    """A batch built so the capped tokens are known before any loss runs: log ratios of +1 (r = e > cap 1.5) on 5
    of the 11 loss tokens, 3 of them with A > 0 and 2 with A < 0; the others at r = e^0.2 or e^-1. clip_frac must be
    5/11 (every capped token), cispo_clip_frac_pos 3/11. Cross-check from the loss itself: a token's gradient is
    -min(r, cap) A, so where A != 0 the capped ones are those with |grad| = cap |A| < r |A|. The former rule (A > 0
    only) gives 3/11, which fails the first assertion: the negative control."""
    log_ratio = torch.tensor([[1.0, 0.2, 1.0, -1.0, 0.2, 0.0], [1.0, -1.0, 1.0, 0.2, 1.0, 0.2]], dtype=DT)
    adv = torch.tensor([[0.5, 0.5, -0.7, 0.3, -0.2, 0.0], [0.9, -0.4, -0.1, 0.6, 0.4, 0.8]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=DT)
    old = torch.full_like(log_ratio, -2.0)
    logp = (old + log_ratio).requires_grad_(True)
    _, m = policy_loss("cispo")(logp, old, adv, mask, _cfg_for("cispo", epsilon_high=1.5))
    assert float(m["clip_frac"]) == pytest.approx(5 / 11), "every capped token, whatever the sign of A"
    assert float(m["cispo_clip_frac_pos"]) == pytest.approx(3 / 11)
    out, _ = policy_loss("cispo")(logp, old, adv, mask, _cfg_for("cispo", epsilon_high=1.5))
    grad = torch.autograd.grad(out.sum(), logp)[0]
    on = (mask > 0) & (adv != 0)
    capped = (grad.abs() < torch.exp(log_ratio) * adv.abs() - 1e-9) & on
    assert int(capped.sum()) == 5 and torch.allclose(grad.abs()[capped], 1.5 * adv.abs()[capped])


def test_seq_mean_token_sum_is_verls_definition():
    """verl agg_loss 'seq-mean-token-sum': per-sequence token sums, mean over sequences (a loop reference)."""
    from mgrpo.loss.aggregation import token_weights
    from mgrpo.rollout.types import Sample

    logp, old, ref, adv, mask, W = make_batch(seed=6)
    out, _ = policy_loss("ppo_clip")(logp, old, adv, mask, cfg_of())
    rows = [sum(float(out[b, t]) for t in range(out.shape[1]) if mask[b, t]) for b in range(out.shape[0])]
    expect = sum(rows) / len(rows)
    assert float(aggregate_reference(out, mask, "seq-mean-token-sum")) == pytest.approx(expect, abs=1e-12)
    samples = [
        Sample(prompt_ids=[0], response_ids=[0] * int(mask.shape[1]), loss_mask=mask[b].int().tolist())
        for b in range(mask.shape[0])
    ]
    w = torch.tensor(token_weights(samples, "seq-mean-token-sum"), dtype=DT)
    assert float((w * out).sum()) == pytest.approx(expect, abs=1e-12)
    assert float(aggregate_reference(out, mask, "seq-mean-token-mean")) != pytest.approx(expect)


# ---------------------------------------------------------------------------------------------------- sapo
def test_sapo_gate_is_the_policy_gradient_on_policy_and_smooth_off_it():
    """At r = 1 the gradient is exactly -A grad logp (f'(1) = 1); far off-policy it decays smoothly but never to
    exactly 0 as a hard clip would; negative advantages decay faster (tau_neg > tau_pos)."""
    logp, _, _, _, mask, _ = make_batch(seed=31, spread=0.0)
    adv = torch.where(torch.arange(logp.shape[0])[:, None] % 2 == 0, 1.0, -1.0).to(DT).expand_as(logp) * mask
    cfg = _cfg_for("sapo", tau_pos=1.0, tau_neg=1.05)
    out, m = policy_loss("sapo")(logp, logp.detach(), adv, mask, cfg)
    (g,) = torch.autograd.grad(out.sum(), logp)
    assert torch.allclose(g, -adv, atol=1e-12) and m["sapo_grad_weight"] == pytest.approx(1.0)
    assert torch.allclose(out, -2 * adv / torch.where(adv > 0, 1.0, 1.05), atol=1e-12)  # f(1) = 2 / tau
    far, _ = policy_loss("sapo")(logp, logp.detach() - 3.0, adv, mask, cfg)  # r = e^3
    (gf,) = torch.autograd.grad(far.sum(), logp)
    on = mask > 0
    assert (gf[on].abs() > 0).all() and (gf[on].abs() < 0.5 * adv[on].abs()).all()


def test_sapo_negative_control_swapped_temperatures_fail_the_reference():
    """The reference catches a SAPO that used tau_pos for negative advantages (and the reverse)."""
    logp, old, _, adv, mask, W = make_batch(seed=37, spread=0.8)
    cfg = _cfg_for("sapo")
    out, _ = policy_loss("sapo")(logp, old, adv, mask, _cfg_for("sapo", tau_pos=cfg.tau_neg, tau_neg=cfg.tau_pos))
    with pytest.raises(AssertionError):
        check(out, ref_loss("sapo", logp, old, adv, mask, cfg), logp, W)
