"""Tests for mgrpo.loss.logprobs.vocab_parallel_logprobs.

Everything is compared against a float64 full-vocabulary reference: the shards are
concatenated, padded columns (global index >= vocab_size) are dropped, and
``log_softmax(full.double() / T)`` is differentiated with autograd.

Tolerances (max over elements, ``b`` = float64 reference):
* fp32 logits: ``|a - b| <= 1e-5``.
* bf16 logits (the reference is float64 from the same bf16 values; outputs are fp32 but
  the gradient comes back in bf16, so its own rounding is ~4e-3 relative):
  ``|a - b| <= 2e-2 + 2e-2 * |b|``.

TP2 / TP4 run on gloo process groups, one ``torch.multiprocessing.spawn`` launch per
world size; the TP2 launch also runs the world-of-one case through real (size 1) gloo
subgroups. Workers write per-check results to JSON files and the pytest process asserts.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import mgrpo  # noqa: F401
except ImportError:  # running pytest without the package installed: use the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mgrpo.loss.logprobs import vocab_parallel_logprobs  # noqa: E402

IGN = -100
TOL = {torch.float32: (1e-5, 0.0), torch.bfloat16: (2e-2, 2e-2)}


# --------------------------------------------------------------------------- helpers
def excess(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> float:
    """max(|a - b| - rtol * |b|) - atol; <= 0 means within tolerance (inf for NaN)."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return -atol
    d = (a - b).abs() - rtol * b.abs()
    if not torch.isfinite(d).all():
        return float("inf")
    return float(d.max()) - atol


def reference(full, targets, temperature, vocab_size, w1, w2):
    """float64 logprob, entropy and grads of sum(w1*lp), sum(w2*H), sum(w1*lp + w2*H)
    w.r.t. the full (padded) logits; padded columns get zero gradient."""
    x = full.detach().double().requires_grad_()
    lp_all = torch.log_softmax(x[..., :vocab_size] / temperature, dim=-1)
    ok = targets != IGN
    lp = lp_all.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(ok, lp, torch.zeros_like(lp))
    ent = -(lp_all.exp() * lp_all).sum(-1)
    ent = torch.where(ok, ent, torch.zeros_like(ent))
    w1, w2 = w1.double(), w2.double()
    (g1,) = torch.autograd.grad((w1 * lp).sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad((w2 * ent).sum(), x, retain_graph=True)
    (g12,) = torch.autograd.grad((w1 * lp + w2 * ent).sum(), x)
    return lp.detach(), ent.detach(), g1, g2, g12


def fused(shard, targets, group, temperature, chunk, vocab_size, w1, w2, entropy=True):
    x = shard.detach().clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        x, targets, group, temperature=temperature, compute_entropy=entropy, chunk_size=chunk, vocab_size=vocab_size
    )
    if not entropy:
        assert ent is None
        (g1,) = torch.autograd.grad((w1 * lp).sum(), x)
        return lp.detach(), g1
    (g1,) = torch.autograd.grad((w1 * lp).sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad((w2 * ent).sum(), x, retain_graph=True)
    (g12,) = torch.autograd.grad((w1 * lp + w2 * ent).sum(), x)
    return lp.detach(), ent.detach(), g1, g2, g12


def make_case(seed, shape, padded, vocab_size, dtype, pad_value=20.0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(*shape, padded, generator=g) * 3.0
    full[..., vocab_size:] = pad_value  # large padding logits: unmasked padding would show
    full = full.to(dtype)
    targets = torch.randint(0, vocab_size, shape, generator=g)
    flat = targets.view(-1)
    flat[0] = vocab_size - 1
    flat[1] = 0
    flat[torch.rand(flat.shape, generator=g) < 0.2] = IGN
    flat[2] = IGN
    w1 = torch.randn(shape, generator=g)
    w2 = torch.randn(shape, generator=g)
    return full, targets, w1, w2


def run_cases(
    group, tag, vocab_configs, dtypes=(torch.float32, torch.bfloat16), temperatures=(1.0, 0.7), chunks=(7, None)
):
    """All cases for one process group; returns a list of result dicts (never raises)."""
    rank = 0 if group is None else dist.get_rank(group)
    world = 1 if group is None else dist.get_world_size(group)
    results = []
    seed = 0
    for padded, vocab_size in vocab_configs:
        v_local = padded // world
        for dtype in dtypes:
            atol, rtol = TOL[dtype]
            for temp in temperatures:
                for chunk in chunks:
                    seed += 1
                    case = f"{tag} rank{rank} V={vocab_size}/{padded} {str(dtype)[6:]} T={temp} chunk={chunk}"
                    try:
                        full, targets, w1, w2 = make_case(seed, (3, 5), padded, vocab_size, dtype)
                        shard = full[..., rank * v_local : (rank + 1) * v_local]
                        ref = reference(full, targets, temp, vocab_size, w1, w2)
                        sl = slice(rank * v_local, (rank + 1) * v_local)
                        ref = ref[:2] + tuple(g[..., sl] for g in ref[2:])
                        out = fused(shard, targets, group, temp, chunk, vocab_size, w1, w2)
                        names = ("logprob", "entropy", "grad_w1_logprob", "grad_w2_entropy", "grad_both")
                        for name, a, b in zip(names, out, ref):
                            ex = excess(a, b, atol, rtol)
                            results.append(dict(case=case, check=name, excess=ex, ok=ex <= 0))
                        assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
                        assert out[2].dtype == dtype
                        # logprob-only path agrees with the entropy path
                        lp_only, g_only = fused(shard, targets, group, temp, chunk, vocab_size, w1, w2, entropy=False)
                        for name, a, b in (("logprob_only", lp_only, ref[0]), ("grad_logprob_only", g_only, ref[2])):
                            ex = excess(a, b, atol, rtol)
                            results.append(dict(case=case, check=name, excess=ex, ok=ex <= 0))
                        ign = targets == IGN
                        zero_ok = bool(
                            (out[0][ign] == 0).all()
                            and (out[1][ign] == 0).all()
                            and (out[4][ign] == 0).all()
                            and (out[0] <= 0).all()
                        )
                        results.append(
                            dict(
                                case=case,
                                check="ignore_zero_and_nonpositive",
                                excess=0.0 if zero_ok else 1.0,
                                ok=zero_ok,
                            )
                        )
                    except Exception:  # noqa: BLE001 - reported by the pytest process
                        results.append(
                            dict(
                                case=case, check="exception", excess=float("inf"), ok=False, msg=traceback.format_exc()
                            )
                        )
    return results


def assert_results(results, min_checks):
    bad = [r for r in results if not r["ok"]]
    msg = "\n".join(
        f"{r['case']}: {r['check']} exceeds tolerance by {r['excess']:.3g}" + (f"\n{r['msg']}" if "msg" in r else "")
        for r in bad[:20]
    )
    assert not bad, f"{len(bad)}/{len(results)} checks failed:\n{msg}"
    assert len(results) >= min_checks, f"only {len(results)} checks ran"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VOCABS = {2: [(256, 256), (256, 250)], 4: [(256, 256), (256, 250), (256, 190)]}  # 190: rank 3 holds only padding


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    results = []
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        results += run_cases(dist.group.WORLD, f"tp{world}", VOCABS[world])
        if world == 2:  # world-of-one through a real gloo group
            subs = [dist.new_group([r]) for r in range(world)]
            results += run_cases(subs[rank], "tp1-gloo", [(256, 250)], dtypes=(torch.float32,), temperatures=(0.7,))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results.append(
            dict(
                case=f"tp{world} rank{rank}",
                check="worker crashed",
                excess=float("inf"),
                ok=False,
                msg=traceback.format_exc(),
            )
        )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


# --------------------------------------------------------------------------- TP tests
def test_tp1_matches_reference():
    results = run_cases(None, "tp1", [(256, 256), (256, 250)])
    assert_results(results, min_checks=2 * 2 * 2 * 2 * 8)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_gloo_matches_reference(world, tmp_path):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results"
        results += json.loads(path.read_text())
    n_cases = len(VOCABS[world]) * 8
    assert_results(results, min_checks=world * n_cases * 8)


# --------------------------------------------------------------------------- single process
def test_large_logits_finite_and_nonpositive():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g) * 1e4
    t = torch.randint(0, 512, (64,), generator=g)
    t[:16] = x[:16].argmax(-1)  # target is the max: logprob exactly 0 (or tiny negative)
    t[16] = IGN
    w1, w2 = torch.randn(64, generator=g), torch.randn(64, generator=g)
    for temp in (1.0, 0.7):
        for dtype in (torch.float32, torch.bfloat16):
            xi = x.to(dtype)
            lp, ent, g1, g2, g12 = fused(xi, t, None, temp, 5, None, w1, w2)
            for name, v in (("lp", lp), ("ent", ent), ("g1", g1), ("g2", g2), ("g12", g12)):
                assert torch.isfinite(v).all(), f"{name} not finite (T={temp}, {dtype})"
            assert (lp <= 0).all(), f"positive logprob {lp.max()} (T={temp}, {dtype})"
            assert (ent >= 0).all()
            ref = reference(xi, t, temp, 512, w1, w2)
            # logprobs of size ~1e4: fp32 rounding of logits/T gives ~1e-3 absolute
            where = f"T={temp}, {dtype}"
            assert excess(lp, ref[0], 1e-2, 1e-6) <= 0, where
            assert excess(ent, ref[1], 1e-3, 1e-6) <= 0, where
            gtol = (1e-4, 1e-4) if dtype == torch.float32 else TOL[dtype]  # bf16 grad output
            assert excess(g12, ref[4], *gtol) <= 0, where


def test_default_chunk_size():
    from mgrpo.loss.logprobs import default_chunk_size

    assert default_chunk_size(152064) == 27 and default_chunk_size(76032) == 55
    assert default_chunk_size(1 << 23) == 1 and default_chunk_size(256) == 1 << 14
    # on a GPU, from its free memory: a 1/16 share up to 1 GiB per fp32 temporary (70 GiB free, V/TP = 76032)
    cuda = torch.device("cuda", 0)
    assert default_chunk_size(76032, cuda, free_bytes=70 << 30) == (1 << 30) // (4 * 76032) == 3530
    assert default_chunk_size(76032, cuda, free_bytes=4 << 30) == (256 << 20) // (4 * 76032)
    assert default_chunk_size(1 << 30, cuda, free_bytes=1 << 20) == 1


def test_chunk_size_invariance(monkeypatch):
    import mgrpo.loss.logprobs as mod

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 300, generator=g) * 4
    t = torch.randint(0, 290, (4, 16), generator=g)
    t[0, :3] = IGN
    w1, w2 = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    base = fused(x, t, None, 0.7, None, 290, w1, w2)
    for chunk in (1, 5, 64, 10_000, "default=3"):
        if chunk == "default=3":  # chunk_size=None with a default that splits into chunks
            monkeypatch.setattr(mod, "DEFAULT_CHUNK_ELEMENTS", 3 * 300)
            out = fused(x, t, None, 0.7, None, 290, w1, w2)
        else:
            out = fused(x, t, None, 0.7, chunk, 290, w1, w2)
        for name, a, b in zip(("lp", "ent", "g1", "g2", "g12"), out, base):
            assert excess(a, b, 1e-6, 0.0) <= 0, f"chunk={chunk} changes {name}"


def test_ignore_index_exact_zero():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 40, generator=g)
    for ignore in (IGN, -1):
        t = torch.randint(0, 40, (10,), generator=g)
        t[[1, 4, 7]] = ignore
        xx = x.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(
            xx, t, None, temperature=0.9, compute_entropy=True, chunk_size=3, ignore_index=ignore
        )
        assert (lp[[1, 4, 7]] == 0).all() and (ent[[1, 4, 7]] == 0).all()
        assert (lp[[0, 2, 3]] < 0).all() and (ent[[0, 2, 3]] > 0).all()
        (torch.randn(10, generator=g) * lp + torch.randn(10, generator=g) * ent).sum().backward()
        assert (xx.grad[[1, 4, 7]] == 0).all()
        assert (xx.grad[[0, 2, 3]] != 0).any(dim=1).all()
    # everything ignored
    t = torch.full((10,), IGN)
    xx = x.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(xx, t, None, compute_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert (lp == 0).all() and (ent == 0).all() and (xx.grad == 0).all()


@pytest.mark.parametrize("bad", [250, 255, 256, -1, 10**6])
def test_out_of_range_target_raises(bad):
    x = torch.randn(4, 256)
    t = torch.tensor([0, 3, bad, IGN])
    with pytest.raises(ValueError, match=rf"target id {bad}\b.*\b250\b"):
        vocab_parallel_logprobs(x, t, None, vocab_size=250)


def test_in_range_and_ignore_do_not_raise():
    x = torch.randn(3, 256)
    lp, _ = vocab_parallel_logprobs(x, torch.tensor([0, 249, IGN]), None, vocab_size=250)
    assert lp.shape == (3,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_not_modified(dtype):
    x = (torch.randn(2, 9, 64) * 5).to(dtype).requires_grad_()
    before = x.detach().clone()
    t = torch.randint(0, 60, (2, 9))
    lp, ent = vocab_parallel_logprobs(x, t, None, temperature=0.7, compute_entropy=True, chunk_size=4, vocab_size=60)
    assert torch.equal(x.detach(), before)
    (lp.sum() - 0.1 * ent.sum()).backward()
    assert torch.equal(x.detach(), before)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    assert (x.grad[..., 60:] == 0).all()  # padded columns get exactly zero gradient


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 10, (7,), generator=g)
    t[3] = IGN

    def both(inp):
        return vocab_parallel_logprobs(inp, t, None, temperature=0.7, compute_entropy=True, chunk_size=3, vocab_size=10)

    def lp_only(inp):
        return vocab_parallel_logprobs(inp, t, None, temperature=1.3, chunk_size=2, vocab_size=10)[0]

    assert torch.autograd.gradcheck(both, (x,))
    assert torch.autograd.gradcheck(lp_only, (x,))


def test_leading_shapes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 33, generator=g)
    t = torch.randint(0, 33, (2, 6), generator=g)
    lp3, ent3 = vocab_parallel_logprobs(x, t, None, compute_entropy=True, chunk_size=5)
    lp2, ent2 = vocab_parallel_logprobs(x.view(12, 33), t.view(12), None, compute_entropy=True)
    assert lp3.shape == (2, 6) and ent3.shape == (2, 6)
    assert torch.allclose(lp3.view(12), lp2, atol=1e-6) and torch.allclose(ent3.view(12), ent2)
    lp1, _ = vocab_parallel_logprobs(x[0, 0], t[0, 0], None)
    assert lp1.shape == () and torch.allclose(lp1, lp2[0], atol=1e-6)
    # non-contiguous input
    xt = x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    lpn, _ = vocab_parallel_logprobs(xt, t, None)
    lpn.sum().backward()
    assert torch.allclose(lpn, lp3, atol=1e-6) and xt.grad.shape == xt.shape


def test_comparison_has_teeth():
    """Deliberately wrong variants must fail the same comparison the TP tests use."""
    full, t, w1, w2 = make_case(7, (3, 5), 256, 250, torch.float32)
    ref = reference(full, t, 0.7, 250, w1, w2)
    good = fused(full, t, None, 0.7, 7, 250, w1, w2)
    assert excess(good[0], ref[0], 1e-5, 0) <= 0 and excess(good[4], ref[4], 1e-5, 0) <= 0
    # (a) padded columns not masked
    no_mask = fused(full, t, None, 0.7, 7, None, w1, w2)
    for a, b in zip(no_mask, ref):
        assert excess(a, b, 1e-3, 0.0) > 0
    # (b) temperature ignored
    no_temp = fused(full, t, None, 1.0, 7, 250, w1, w2)
    for a, b in zip(no_temp, ref):
        assert excess(a, b, 1e-3, 0.0) > 0
    # (c) entropy gradient without the "+ H" term: -(p/T) * log p
    x = full.detach()[..., :250].double() / 0.7
    logp = torch.log_softmax(x, -1)
    ok = (t != IGN).unsqueeze(-1)
    wrong_g2 = torch.where(ok, -(w2.double().unsqueeze(-1) / 0.7) * logp.exp() * logp, 0.0)
    assert excess(wrong_g2, ref[3][..., :250], 1e-3, 0.0) > 0
    assert excess(good[3][..., :250], ref[3][..., :250], 1e-5, 0.0) <= 0


def test_no_entropy_returns_none_and_fp32():
    x = torch.randn(5, 20, dtype=torch.bfloat16)
    lp, ent = vocab_parallel_logprobs(x, torch.randint(0, 20, (5,)), None)
    assert ent is None and lp.dtype == torch.float32
