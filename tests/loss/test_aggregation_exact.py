"""Aggregation is exact: the same gradient whether the global batch runs as 1x8, 2x4 or 8x1 micro-batches
(unequal response lengths), for every policy loss x aggregation and every ms-swift preset; ms-swift's
per-micro-batch mean is not (the negative control)."""

import itertools

import pytest
import torch
from layout_launch import make_samples

from mgrpo.config import load_config
from mgrpo.data.microbatch import make_microbatches
from mgrpo.loss.aggregation import per_microbatch_mean_weights, token_weights
from mgrpo.loss.presets import AGGREGATIONS, PRESETS, aggregate_reference, apply_preset

TOL = 1e-6


@pytest.fixture(scope="module")
def setup(single_rank, tiny_dirs):
    from mgrpo.actor import Actor

    model = tiny_dirs("agg_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=5)
    samples = make_samples(model)
    lengths = sorted(sum(s.loss_mask) for s in samples)
    assert len(set(lengths)) > 4, "response lengths must differ"
    cfg = load_config(argv=["--model.path", model, "--data.path", "unused.jsonl"], check_files=False)
    return cfg, Actor(cfg, model), samples


def grads(actor, samples, mbs_size, weights):
    advs = [s.info["advantage"] for s in samples]
    mbs = make_microbatches(samples, mbs_size, 0, advs, token_weights=weights)
    for mb in mbs:
        mb["old_logp"] = mb["rollout_logp"]
    stats = actor.forward_backward(mbs)
    loss = sum(float(s["loss_sum"]) for s in stats)
    return loss, torch.cat([p.main_grad.reshape(-1).clone() for c in actor.chunks for p in c.parameters()])


def run(setup, weights_of, **alg):
    cfg, actor, samples = setup
    for k, v in alg.items():
        setattr(actor.cfg.algorithm, k, v)
    out = {}
    for size in (8, 4, 1):  # 1x8, 2x4 and 8x1 micro-batches
        out[size] = grads(actor, samples, size, weights_of(samples, size))
    return out


CASES = list(itertools.product(["ppo_clip", "gspo", "gspo_token", "cispo"], AGGREGATIONS))


@pytest.mark.parametrize("loss,agg", CASES)
def test_split_invariance(setup, loss, agg):
    res = run(setup, lambda s, _: token_weights(s, agg, 32), policy_loss=loss, aggregation=agg)
    ref_loss, ref_grad = res[8]
    assert ref_grad.abs().max() > 1e-4, "the gradient must not be trivially zero"
    for size in (4, 1):
        loss, g = res[size]
        # fp32: the loss to 1e-6 relative (seq-mean-token-sum sums tokens, so its loss is ~10 here)
        assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss)) and (g - ref_grad).abs().max() <= TOL, (
            f"{loss}/{agg}: {8 // size}x{size} differs by {(g - ref_grad).abs().max():.2e}"
        )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_split_invariant_and_match_reference(setup, preset):
    cfg, actor, samples = setup
    alg = apply_preset(cfg.algorithm, preset)
    res = run(
        setup,
        lambda s, _: token_weights(s, alg.aggregation, 32),
        policy_loss=alg.policy_loss,
        aggregation=alg.aggregation,
        epsilon_low=alg.epsilon_low,
        epsilon_high=alg.epsilon_high,
    )
    for size in (4, 1):
        assert (res[size][1] - res[8][1]).abs().max() <= TOL
    # the distributed weights give the same loss as the single-batch definition of the aggregation
    from mgrpo.loss.registry import policy_loss

    advs = [s.info["advantage"] for s in samples]
    mb = make_microbatches(samples, 8, 0, advs)[0]
    with torch.no_grad():
        logp = actor.logprobs([mb])[0]
    per_token, _ = policy_loss(alg.policy_loss)(logp, mb["rollout_logp"], mb["advantages"], mb["loss_mask"], alg)
    ref = aggregate_reference(per_token, mb["loss_mask"], alg.aggregation, max_len=32)
    assert abs(float(ref) - res[8][0]) <= 1e-6


def test_per_microbatch_mean_is_not_exact(setup):
    """ms-swift normalises per micro-batch: with unequal lengths the gradient depends on the split."""
    res = run(setup, per_microbatch_mean_weights, policy_loss="ppo_clip", aggregation="token-mean")
    assert (res[4][1] - res[8][1]).abs().max() > 1e-4
    assert (res[1][1] - res[8][1]).abs().max() > 1e-4


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_split_invariance_within_mini_batches(setup, agg):
    """Each of 2 mini-batches (4 samples, weights from its own counts) gives the same loss and gradient as 1x4,
    2x2 or 4x1 micro-batches."""
    cfg, actor, samples = setup
    for alg_key, value in (("policy_loss", "ppo_clip"), ("aggregation", agg)):
        setattr(actor.cfg.algorithm, alg_key, value)
    for mini in (samples[:4], samples[4:]):
        weights = token_weights(mini, agg, 32)
        ref_loss, ref_grad = grads(actor, mini, 4, weights)
        for size in (2, 1):
            loss, g = grads(actor, mini, size, weights)
            assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss)) and (g - ref_grad).abs().max() <= TOL
