"""Sequence packing and token-budget micro-batches (mgrpo/data/packing.py) at TP1, in-process: on a batch whose
lengths spread from 16 to 512 tokens the packed path's loss and gradients equal the padded path's (abs <= 1e-5, the
reference being the padded run of the same megatron model, megatron's own attention); the negative control (the row
attended as one sequence) breaks it. The TP2, TP2+SP, CP2, PP2 and DP2 layouts run in the shared layout launch against the
padded TP1 run (tests/parallel/test_layouts.py)."""

import time

import pytest
import torch

from mgrpo.data import packing
from mgrpo.data.microbatch import make_microbatches
from mgrpo.rollout.types import Sample

ABS = 1e-5


def test_budget_groups_and_dp_balance():
    lengths = [500, 20, 30, 480, 16, 100, 260, 64]
    packed = packing.budget_groups(lengths, 600, packed=True)
    assert sorted(i for g in packed for i in g) == list(range(8))
    assert all(sum(lengths[i] for i in g) <= 600 or len(g) == 1 for g in packed)
    padded = packing.budget_groups(lengths, 600, packed=False)
    assert all(len(g) * max(lengths[i] for i in g) <= 600 or len(g) == 1 for g in padded)
    shares = [packing.balanced_dp_shard(lengths, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(8)) and len(shares[0]) == len(shares[1]) == 4
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 100, loads  # the first and second half: 1010 / 440


def test_runs_of_a_packed_row():
    from mgrpo.models.cp_attention import _runs

    assert _runs(torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])) == [(0, 2), (2, 5), (5, 6), (6, 8)]
    assert _runs(torch.tensor([4])) == [(0, 1)]


def spread_samples(n=8, seed=0):
    """Lengths from 16 to 512 tokens; an environment-written (masked) token inside some responses."""
    g = torch.Generator().manual_seed(seed)
    totals = [16, 512, 40, 300, 90, 24, 180, 420][:n]
    out = []
    for i, total in enumerate(totals):
        p = max(4, total // 3)
        prompt = torch.randint(3, 300, (p,), generator=g).tolist()
        resp = torch.randint(3, 300, (total - p,), generator=g).tolist()
        mask = [1] * len(resp)
        if i % 3 == 0:
            mask[len(resp) // 2] = 0
        s = Sample(prompt_ids=prompt, response_ids=resp, loss_mask=mask, group_id=i // 4)
        s.rollout_logprobs = (-torch.rand(len(resp), generator=g) * 3).tolist()
        out.append(s)
    return out


@pytest.fixture(scope="module")
def actors(single_rank, tiny_dirs):
    """{False: the padded path's actor (megatron's local attention), True: the packed path's (ours)}."""
    from mgrpo.actor import Actor
    from mgrpo.config import load_config

    model = tiny_dirs("packing_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=4)
    out = {}
    for packing_on in (False, True):
        cfg = load_config(
            argv=["--model.path", model, "--data.path", "unused.jsonl", "--algorithm.policy_loss", "gspo"],
            check_files=False,
        )  # a sequence-level ratio
        cfg.train.sequence_packing = packing_on
        out[packing_on] = Actor(cfg, model)
    return out


def run(actors, samples, packing_on: bool, budget: int = 0):
    actor = actors[packing_on]
    from mgrpo.loss.aggregation import token_weights

    groups = (
        packing.budget_groups([len(s.prompt_ids) + len(s.response_ids) for s in samples], budget, packing_on)
        if budget
        else None
    )
    weights = token_weights(samples, actor.cfg.algorithm.aggregation, 512)
    advs = [float(i % 3) - 1.0 for i in range(len(samples))]
    mbs = make_microbatches(samples, 4, 0, advs, token_weights=weights, groups=groups, packing=packing_on)
    started = time.perf_counter()
    stats = actor.forward_backward(mbs)
    seconds = time.perf_counter() - started
    grads = {n: p.main_grad.clone() for n, p in actor.chunks[0].named_parameters()}
    loss = sum(float(s["loss_sum"]) for s in stats)
    run_tokens = sum(packing.model_inputs(mb)[0].numel() for mb in mbs)
    return loss, grads, seconds, run_tokens


def worst(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_packed_equals_padded_on_lengths_16_to_512(actors):
    samples = spread_samples()
    real = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    loss0, grads0, t0, run0 = run(actors, samples, False)
    loss1, grads1, t1, run1 = run(actors, samples, True)
    loss2, grads2, t2, run2 = run(actors, samples, True, budget=700)
    print(
        f"\npadded: {run0} tokens run ({1 - real / run0:.0%} padding), {t0:.2f} s; packed: {run1} tokens "
        f"({1 - real / run1:.0%}), {t1:.2f} s; packed by 700-token budget: {run2} tokens, {t2:.2f} s"
    )
    print(
        f"loss diff {abs(loss1 - loss0):.1e} / {abs(loss2 - loss0):.1e}, grad diff {worst(grads1, grads0):.1e} / "
        f"{worst(grads2, grads0):.1e}"
    )
    assert run1 == real and run0 > 1.5 * real
    assert abs(loss1 - loss0) <= ABS and abs(loss2 - loss0) <= ABS
    assert worst(grads1, grads0) <= ABS and worst(grads2, grads0) <= ABS
    assert max(float(g.abs().max()) for g in grads0.values()) > 1e-2, "the gradients are not trivially zero"


def test_negative_control_attention_across_samples(actors, monkeypatch):
    """Without the segments the packed row is one causal sequence: each sample also sees the samples before it."""
    samples = spread_samples(4, seed=1)
    loss0, grads0, _, _ = run(actors, samples, False)
    import contextlib

    from mgrpo.models import cp_attention

    with monkeypatch.context() as m:  # the row attended as one sequence (causal over every sample before)
        m.setattr(cp_attention, "attend_within", lambda segments: contextlib.nullcontext())
        _, grads, _, _ = run(actors, samples, True)
    assert worst(grads, grads0) > 1e-3
    _, grads1, _, _ = run(actors, samples, True)
    assert worst(grads1, grads0) <= ABS


def test_rope_positions_restart_with_each_sample(actors):
    """RoPE is relative, so within-sample attention does not see a constant offset (the row positions give the same
    result up to rounding); the packed row still takes each token's angle at its position in its sample, as the
    padded path does (large angles lose precision in bf16)."""
    model = actors[True].models()[0]
    table = model.rotary_pos_emb(64)
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    with packing.packed_rope(model, positions):
        got = model.rotary_pos_emb(len(positions))
    assert torch.equal(got, table[positions])
    assert torch.equal(model.rotary_pos_emb(64), table), "megatron's own forward is back after the row"
