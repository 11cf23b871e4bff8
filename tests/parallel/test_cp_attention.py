"""Context parallelism without TransformerEngine: zigzag split/gather, CPDotProductAttention, cp_seq_sum, RoPE.

One torchrun launch of 4 gloo processes runs, in turn, CP1 (DP4), CP4, CP2xDP2 (two CP groups: WORLD would be
wrong) and TP2xCP2. Every rank compares against a single-process float64 reference computed from the same full
tensors, and writes max abs differences to JSON; the tests below read them. This file is also the worker.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 4
TAGS = ["cp1", "cp4", "cp2dp2", "tp2cp2"]
TOL = 1e-5
S, B, H, G, D = 16, 2, 4, 2, 32  # seq, batch, heads, query groups (GQA), head dim


# ----------------------------------------------------------------------------------------------------------- in-process


def test_zigzag_indices_layout():
    from mgrpo.parallel.context_parallel import cp_position_ids, split_for_cp, zigzag_indices

    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert zigzag_indices(6, 0, 1).tolist() == list(range(6))
    assert cp_position_ids(16, 3, 4).tolist() == [6, 7, 8, 9]
    every = torch.cat([zigzag_indices(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    x = torch.arange(2 * 8 * 3).view(2, 8, 3)
    assert torch.equal(split_for_cp(x, 1, 1, 2), x[:, [2, 3, 4, 5]])
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        split_for_cp(torch.zeros(2, 6), 1, 0, 2)


def test_single_rank_fallbacks():
    from mgrpo.parallel.context_parallel import cp_seq_sum, gather_from_cp

    x = torch.randn(3, 5, requires_grad=True)
    assert torch.equal(cp_seq_sum(None)(x), x.sum(-1))
    assert gather_from_cp(x, 1, None) is x


# ----------------------------------------------------------------------------------------------------- the launch


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    out = tmp_path_factory.mktemp("cp")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        f"--master-port={free_port()}",
        os.path.abspath(__file__),
        "--worker",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"CP workers failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    per_rank = [json.loads((out / f"rank{i}.json").read_text()) for i in range(WORLD)]
    merged = {}  # tag -> metric -> worst over ranks
    for res in per_rank:
        for tag, metrics in res.items():
            for k, v in metrics.items():
                worst = merged.setdefault(tag, {}).get(k)
                if k.startswith("neg_"):  # negative controls: the smallest difference must still be large
                    merged[tag][k] = v if worst is None else min(worst, v)
                else:
                    merged[tag][k] = v if worst is None else max(worst, v)
    print(json.dumps(merged, indent=1))
    return merged


@pytest.mark.slow
def test_split_gather_roundtrip(cp_results):
    for tag in TAGS:
        assert cp_results[tag]["roundtrip"] == 0.0, tag


@pytest.mark.slow
@pytest.mark.parametrize("tag", TAGS)
def test_attention_matches_reference(cp_results, tag):
    m = cp_results[tag]
    for k in ("out", "dq", "dk", "dv"):
        assert m[k] <= TOL, f"{tag} {k}: {m[k]:.2e} > {TOL}"


@pytest.mark.slow
def test_cp1_matches_megatron_dot_product_attention(cp_results):
    m = cp_results["cp1"]
    for k in ("meg_out", "meg_dq", "meg_dk", "meg_dv"):
        assert m[k] <= TOL, f"{k}: {m[k]:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["cp4", "cp2dp2", "tp2cp2"])
def test_contiguous_split_is_detected(cp_results, tag):
    assert cp_results[tag]["neg_contiguous"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("tag", TAGS)
def test_cp_seq_sum(cp_results, tag):
    m = cp_results[tag]
    assert m["seqsum_value"] <= TOL and m["seqsum_grad"] <= TOL, m
    if tag != "cp1":
        assert m["neg_seqsum_identity_backward"] > 1e-3, "a backward without the all-reduce must be wrong"


@pytest.mark.slow
@pytest.mark.parametrize("tag", TAGS)
def test_megatron_rope_slices_zigzag(cp_results, tag):
    assert cp_results[tag]["rope"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["cp4", "cp2dp2"])
def test_gpt_model_with_cp_attention_matches_cp1(cp_results, tag):
    """GPTModel (local spec + CPDotProductAttention) fed zigzag-split input_ids equals the CP1 model."""
    m = cp_results[tag]
    assert m["gpt_logits"] <= TOL, m
    assert m["gpt_grads_rel"] <= TOL, m


# ------------------------------------------------------------------------------------------------------- the worker


def _reference(q, k, v):
    """Plain causal GQA attention, [S, B, H, D] x [S, B, G, D] -> [S, B, H*D]."""
    s, b, h, d = q.shape
    k = k.repeat_interleave(h // k.size(2), dim=2)
    v = v.repeat_interleave(h // v.size(2), dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / d**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * d)


def _maxdiff(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


def _attn_config(tp, cp):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=H * D,
        num_attention_heads=H,
        num_query_groups=G,
        kv_channels=D,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
    )


def _attention_checks(tp, cp, out):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.enums import AttnMaskType

    from mgrpo.models.cp_attention import CPDotProductAttention
    from mgrpo.parallel.context_parallel import (
        all_gather_seq_rank_major,
        cp_seq_sum,
        gather_from_cp,
        split_for_cp,
        zigzag_indices,
    )

    group = mpu.get_context_parallel_group()
    cp_rank, cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
    assert cp_size == cp == dist.get_world_size(group)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(100 + mpu.get_data_parallel_rank())  # each DP replica has its own data
    q_all = torch.randn(S, B, H, D, generator=g)
    k_all, v_all = torch.randn(S, B, G, D, generator=g), torch.randn(S, B, G, D, generator=g)
    w_all = torch.randn(S, B, H * D, generator=g)
    # this TP rank's heads: queries [tp_rank*H/tp, ...), groups [tp_rank*G/tp, ...), output columns alike
    hq, hg = H // tp, G // tp
    q = q_all[:, :, tp_rank * hq : (tp_rank + 1) * hq].contiguous()
    k = k_all[:, :, tp_rank * hg : (tp_rank + 1) * hg].contiguous()
    v = v_all[:, :, tp_rank * hg : (tp_rank + 1) * hg].contiguous()
    w = w_all[:, :, tp_rank * hq * D : (tp_rank + 1) * hq * D].contiguous()

    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = _reference(*ref_in)
    (ref_out * w.double()).sum().backward()

    attn = CPDotProductAttention(
        _attn_config(tp, cp), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    loc = [split_for_cp(t, 0, cp_rank, cp_size).clone().requires_grad_() for t in (q, k, v)]
    o = attn(*loc, attention_mask=None)
    assert o.shape == (S // cp, B, hq * D)
    (o * split_for_cp(w, 0, cp_rank, cp_size)).sum().backward()
    out["out"] = _maxdiff(gather_from_cp(o.detach(), 0, group), ref_out)
    for name, t, r in zip(("dq", "dk", "dv"), loc, ref_in):
        out[name] = _maxdiff(gather_from_cp(t.grad, 0, group), r.grad)
    out["roundtrip"] = _maxdiff(gather_from_cp(split_for_cp(w, 0, cp_rank, cp_size), 0, group), w)

    if cp > 1:  # negative control: contiguous chunks into an attention that masks by zigzag positions
        contiguous = [t.chunk(cp, dim=0)[cp_rank].contiguous() for t in (q, k, v)]
        with torch.no_grad():
            oc = all_gather_seq_rank_major(attn(*contiguous, attention_mask=None), 0, group)
        out["neg_contiguous"] = _maxdiff(oc, ref_out)

    if cp == 1 and tp == 1:  # our reference (and CPDotProductAttention) == megatron's own local core attention
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from mgrpo.models.forward import causal_mask

        meg = DotProductAttention(
            _attn_config(1, 1), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        mi = [t.clone().requires_grad_() for t in (q, k, v)]
        mo = meg(*mi, attention_mask=causal_mask(S))
        (mo * w).sum().backward()
        out["meg_out"] = _maxdiff(mo, o)
        for name, t, r in zip(("meg_dq", "meg_dk", "meg_dv"), mi, loc):
            out[name] = _maxdiff(t.grad, r.grad)

    # cp_seq_sum: rank k's loss L_k = sum_b (c_k . x_k)_b / y_b + y_b^2 / cp (replicated term divided by cp);
    # the total sum_k L_k equals the single-process J = sum_b (c . x)_b / y_b + y_b^2.
    x_all = torch.rand(B, S, generator=g) + 0.5
    c_all = torch.randn(B, S, generator=g)
    xr = x_all.double().requires_grad_()
    y_ref = xr.sum(-1)
    ((c_all.double() * xr).sum(-1) / y_ref + y_ref**2).sum().backward()
    f = cp_seq_sum(group)
    c_loc = split_for_cp(c_all, 1, cp_rank, cp_size)

    def seq_grad(local_only):
        x = split_for_cp(x_all, 1, cp_rank, cp_size).clone().requires_grad_()
        y = f(x)
        if local_only:  # what an all-reduce with an identity backward would give
            y = x.sum(-1) + (y - x.sum(-1)).detach()
        ((c_loc * x).sum(-1) / y + y**2 / cp_size).sum().backward()
        return y, gather_from_cp(x.grad, 1, group)

    y, gx = seq_grad(False)
    out["seqsum_value"] = _maxdiff(y, y_ref)
    out["seqsum_grad"] = _maxdiff(gx, xr.grad)
    if cp > 1:
        out["neg_seqsum_identity_backward"] = _maxdiff(seq_grad(True)[1], xr.grad)

    # megatron's RoPE slices its full-length table for this CP rank exactly like zigzag_indices
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0, use_cpu_initialization=True, cp_group=group)
    emb = rope(S)
    assert emb.shape[0] == S // cp
    out["rope"] = _maxdiff(emb, rope.get_emb(S)[zigzag_indices(S, cp_rank, cp_size)])


def _model_info():
    from mgrpo.models.hf_config import ModelInfo

    return ModelInfo(
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        vocab_size=300,
        hidden_size=H * D,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=G,
        head_dim=D,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=True,
    )


def _build_gpt(parallel):
    import mgrpo.models.builder as builder
    from mgrpo.models.cp_attention import CPDotProductAttention

    plain = builder.layer_spec

    def cp_spec(config, use_te=None, experts=False, packing=False, fused_attention=False):
        spec = plain(config, use_te=False, experts=experts)
        spec.submodules.self_attention.submodules.core_attention = CPDotProductAttention
        return spec

    builder.layer_spec = cp_spec
    try:
        return builder.build_model(_model_info(), parallel)[0]
    finally:
        builder.layer_spec = plain


def _gpt_checks(parallel, ref, out):
    """GPTModel at CP>1 fed zigzag input_ids (RoPE sliced by megatron itself) vs the CP1 model's logits/grads."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mgrpo.parallel.context_parallel import cp_position_ids, split_for_cp

    group = mpu.get_context_parallel_group()
    cp_rank, cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
    model = _build_gpt(parallel)
    model.load_state_dict(ref["state"])
    ids = split_for_cp(ref["ids"], 1, cp_rank, cp_size)
    pos = cp_position_ids(S, cp_rank, cp_size)[None].expand(B, -1)
    logits = model(ids, pos, None)
    assert logits.shape[:2] == (B, S // cp_size)
    (logits * split_for_cp(ref["w"], 1, cp_rank, cp_size)).sum().backward()
    out["gpt_logits"] = _maxdiff(logits.detach(), split_for_cp(ref["logits"], 1, cp_rank, cp_size))
    worst = 0.0  # relative to each parameter's largest reference gradient (fp32 sums in another order)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # what DDP's reduction over DP x CP does
        worst = max(worst, _maxdiff(grad, ref["grads"][name]) / float(ref["grads"][name].abs().max()))
    out["gpt_grads_rel"] = worst


def _gpt_reference(parallel):
    from mgrpo.models.forward import causal_mask, position_ids

    model = _build_gpt(parallel)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 300, (B, S), generator=g)
    logits = model(ids, position_ids(B, S), causal_mask(S))
    w = torch.randn(logits.shape, generator=g)
    (logits * w).sum().backward()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    return {
        "state": state,
        "ids": ids,
        "w": w,
        "logits": logits.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def _worker(out_dir):
    import torch.distributed as dist

    from mgrpo.config import ParallelConfig
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel, teardown_model_parallel

    torch.set_num_threads(1)
    init_distributed()
    layouts = {
        "cp1": ParallelConfig(),
        "cp4": ParallelConfig(cp=4),
        "cp2dp2": ParallelConfig(cp=2),
        "tp2cp2": ParallelConfig(tp=2, cp=2),
    }
    results, ref = {}, None
    t0 = time.time()
    for tag, parallel in layouts.items():
        setup_model_parallel(parallel)
        out = results[tag] = {}
        _attention_checks(parallel.tp, parallel.cp, out)
        if tag == "cp1":
            ref = _gpt_reference(parallel)
        elif parallel.tp == 1:
            _gpt_checks(parallel, ref, out)
        teardown_model_parallel()
        if os.environ.get("CP_TEST_TIMING") and dist.get_rank() == 0:
            print(f"{tag}: {time.time() - t0:.1f}s", flush=True)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert sys.argv[1] == "--worker", sys.argv
    sys.path.insert(0, ROOT)
    _worker(sys.argv[2])
