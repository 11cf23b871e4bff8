"""Sequence packing and token-budget micro-batches (mgrpo/data/packing.py) at TP1, in-process: on a batch whose
lengths spread from 16 to 512 tokens the packed path's loss and gradients equal the padded path's (abs <= 1e-5, the
reference being the padded run of the same megatron model, megatron's own attention); the negative control (the row
attended as one sequence) breaks it. The same holds for the THD path TE takes on a GPU (megatron's PackedSeqParams
and its per-sequence RoPE), driven here through a plain-torch varlen attention in TE's place. The TP2, TP2+SP, CP2, PP2 and DP2 layouts run in the shared layout launch against the
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


class VarlenReferenceAttention:
    """Stands in for TE's fused attention in THD format (TE does not import on CPU): causal softmax attention within
    each sequence of cu_seqlens, in plain torch (fp32 scores), on megatron's [T, heads, head_dim] THD tensors."""

    @staticmethod
    def make():
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class TEDotProductAttention(DotProductAttention):
            def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kw):
                params = kw["packed_seq_params"]
                assert params is not None and params.qkv_format == "thd" and query.dim() == 3
                cu = params.cu_seqlens_q.tolist()
                rep = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
                outs = []
                for a, b in zip(cu[:-1], cu[1:]):
                    q, k, v = (x[a:b].transpose(0, 1).float() for x in (query, key, value))
                    scores = (q @ k.transpose(1, 2)) * self.softmax_scale
                    scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
                    outs.append((scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype))
                return torch.cat(outs).reshape(query.shape[0], -1)

        return TEDotProductAttention


@pytest.fixture(scope="module")
def actors(single_rank, tiny_dirs):
    """{False: the padded path's actor (megatron's local attention), True: the packed path's (ours), "thd": packed
    rows as THD sequences through megatron's PackedSeqParams path (the varlen stand-in in TE's place)}."""
    from megatron.core.extensions import transformer_engine as te  # imports without TE; its classes are None

    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.models import fast_paths

    model = tiny_dirs("packing_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=4)
    out = {}
    for packing_on in (False, True, "thd"):
        cfg = load_config(
            argv=["--model.path", model, "--data.path", "unused.jsonl", "--algorithm.policy_loss", "gspo"],
            check_files=False,
        )  # a sequence-level ratio
        cfg.train.sequence_packing = bool(packing_on)
        with pytest.MonkeyPatch.context() as m:
            if packing_on == "thd":  # what attention_choice gives LoRA on a GPU: local linears, TE attention, THD
                m.setattr(te, "TEDotProductAttention", VarlenReferenceAttention.make())
                m.setattr(fast_paths, "attention_choice", lambda *a: fast_paths.AttentionChoice(False, True, True))
            out[packing_on] = Actor(cfg, model)
    assert out["thd"].thd and not out[True].thd
    return out


def run(actors, samples, packing_on: bool, budget: int = 0):
    actor = actors[packing_on]
    from mgrpo.loss.aggregation import token_weights

    groups = (
        packing.budget_groups([len(s.prompt_ids) + len(s.response_ids) for s in samples], budget, bool(packing_on))
        if budget
        else None
    )
    weights = token_weights(samples, actor.cfg.algorithm.aggregation, 512)
    advs = [float(i % 3) - 1.0 for i in range(len(samples))]
    mbs = make_microbatches(samples, 4, 0, advs, token_weights=weights, groups=groups, packing=bool(packing_on))
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


def test_thd_packing_equals_padded(actors, monkeypatch):
    """The THD path (TE's on a GPU): megatron's PackedSeqParams through the model, RoPE per sequence from cu_seqlens
    (megatron's own code), attention within each sequence: loss and gradients equal the padded path's (abs <= 1e-5).
    Negative control: cu_seqlens of one sequence over the whole row."""
    samples = spread_samples(6, seed=2)
    loss0, grads0, _, _ = run(actors, samples, False)
    loss1, grads1, _, run1 = run(actors, samples, "thd")
    print(f"\nTHD: loss diff {abs(loss1 - loss0):.1e}, grad diff {worst(grads1, grads0):.1e}, {run1} tokens run")
    assert abs(loss1 - loss0) <= ABS and worst(grads1, grads0) <= ABS
    assert run1 == sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    one_sequence = packing.thd_params
    monkeypatch.setattr(packing, "thd_params", lambda segments: one_sequence(torch.zeros_like(segments)))
    _, grads2, _, _ = run(actors, samples, "thd")
    assert worst(grads2, grads0) > 1e-3


def test_thd_params_of_a_packed_row():
    params = packing.thd_params(torch.tensor([0, 0, 0, 1, 2, 2, 3, 3]))
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 4, 6, 8]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == 3


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
