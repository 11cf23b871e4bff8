"""The top-entropy token mask (mgrpo/loss/entropy_mask.py) against references written here: torch.quantile for the
threshold, a float64 count for the kept share, TRL's order for the loss (the policy term times the mask, the KL term
untouched). DP2 = DP1 and CP2 = CP1 at the trainer's level are in the layout matrix (tests/parallel/test_layouts.py,
`-topent` tags, with the per-rank quantile as the negative control)."""

import types

import pytest
import torch

from mgrpo.loss.entropy_mask import entropy_threshold, linear_quantile, set_entropy_masks
from mgrpo.loss.registry import policy_loss


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_linear_quantile_is_torch_quantile(n, q):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    assert linear_quantile(x, q) == pytest.approx(float(torch.quantile(x, q)), abs=1e-12)


def microbatches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, length in ((2, 9), (3, 6)):
        mask = (torch.rand(b, length, generator=g) > 0.25).float()
        out.append({"loss_mask": mask, "entropy": torch.rand(b, length, generator=g) * 3 * mask})
    return out


@pytest.mark.parametrize("q", [0.2, 0.5])
def test_the_mask_keeps_the_top_quantile_of_the_loss_tokens(q):
    mbs = microbatches()
    threshold = set_entropy_masks(mbs, q, group=None)
    ents = torch.cat([mb["entropy"][mb["loss_mask"] > 0] for mb in mbs]).double()
    assert threshold == pytest.approx(float(torch.quantile(ents, 1 - q)))
    kept = sum(float(mb["entropy_mask"].sum()) for mb in mbs)
    assert kept == sum(1 for e in ents.tolist() if e >= threshold)  # counted in float64 here
    assert abs(kept / ents.numel() - q) <= 1.0 / ents.numel() + 1e-9
    for mb in mbs:  # never a token off the loss mask
        assert (mb["entropy_mask"][mb["loss_mask"] == 0] == 0).all()


def test_a_split_batch_has_another_threshold_than_the_whole():
    """Why the quantile is gathered over DP x CP: each half alone has its own threshold (the negative control)."""
    mbs = microbatches(seed=3)
    whole = entropy_threshold(mbs, 0.3, None)
    assert entropy_threshold(mbs[:1], 0.3, None) != whole != entropy_threshold(mbs[1:], 0.3, None)


def test_masked_tokens_lose_their_policy_term_only():
    """Zero advantage where masked == TRL's per_token_loss * entropy_mask before the KL term is added."""
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5)
    keep = (torch.rand(3, 5, generator=g) > 0.5).double()
    cfg = types.SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.2, clip_ratio_c=None, kl_coef=0.1, kl_estimator="k3", kl_in_reward=False
    )
    ours, _ = policy_loss("ppo_clip")(logp, old, adv * keep, mask, cfg, ref_logp=ref)
    r = torch.exp(logp - old)
    surrogate = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    x = ref - logp
    k3 = torch.exp(x) - x - 1
    trl = surrogate * keep + 0.1 * k3
    assert torch.allclose(ours, trl, atol=1e-12)
    (g1,) = torch.autograd.grad(ours.sum(), logp, retain_graph=True)
    (g2,) = torch.autograd.grad(trl.sum(), logp)
    assert torch.allclose(g1, g2, atol=1e-12)
