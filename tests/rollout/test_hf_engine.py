"""The HF engine samples from exactly mgrpo's rollout settings and returns that distribution's logprobs, whatever
the model folder's generation_config.json says; batches with left padding change no logprob; each request's seed
alone decides its sample; and a weight update is all or nothing."""

import json
import shutil

import pytest
import torch
from engine_helpers import PROMPTS, reqs, run, trainer_logprobs

from mgrpo.rollout.engines.hf import HFEngine, inverse_cdf, processed_logprobs, request_generator
from mgrpo.rollout.types import SamplingParams
from mgrpo.weights.bucket import BucketError, make_buckets, view_buckets

T = 0.7


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    """A tiny qwen2 whose generation_config.json asks for a repetition penalty and top-k 5."""
    d = tmp_path_factory.mktemp("genconf") / "m"
    shutil.copytree(tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2), d)
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    gen.update(repetition_penalty=1.3, top_k=5, temperature=2.0, do_sample=True)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return str(d)


def make_engine(model_dir, **kw):
    from mgrpo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    return HFEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def _reference_sample(model, prompt, sp, gen):
    """Independent sampler: a full forward of the growing sequence (no KV cache, no padding) per token, and the
    request's next uniform u placed on the float64 cumulative distribution (the first token whose sum exceeds u)."""
    ids, toks = list(prompt), []
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        cdf = torch.softmax(logits / sp.temperature, -1).cumsum(0).tolist()
        u = float(torch.rand(1, generator=gen)[0]) * cdf[-1]
        tok = next(i for i, c in enumerate(cdf) if c > u)
        toks.append(tok)
        ids.append(tok)
    return toks


def test_samples_ignore_generation_config(engine):
    """With EOS ignored, every request's tokens equal an independent plain-softmax sampler fed the request's
    generator: nothing from generation_config.json (penalty 1.3, top-k 5, T=2) entered, and left padding in a
    batch of mixed prompt lengths changed nothing."""
    sp = SamplingParams(temperature=T, max_tokens=16, ignore_eos=True)
    requests = reqs(seed=11, n=1)
    out = run(engine, requests, sp)
    for r, o in zip(requests, out):
        assert o.token_ids == _reference_sample(engine.model, r.prompt_ids, sp, request_generator(r.seed))
        assert o.finish_reason == "length" and len(o.logprobs) == 16
    first = out[0].token_ids
    top5 = [
        torch.topk(engine.model(torch.tensor([PROMPTS[0] + first[:j]])).logits[0, -1], 5).indices.tolist()
        for j in range(len(first))
    ]
    assert sum(t not in k for t, k in zip(first, top5)) > 0, "top_k=5 from generation_config.json must not apply"


def test_after_update_engine_equals_trainer(single_rank, model_dir, tmp_path):
    """New random weights pushed through update_weights: greedy and seeded T=0.7 sampling give, for every sample
    of a mixed-length batch, per-token logprobs equal to the trainer's (megatron) forward on the returned ids."""
    from safetensors.torch import load_file

    from mgrpo.models.tiny import make_tiny_hf

    new_dir = make_tiny_hf(str(tmp_path / "new"), family="qwen2", vocab_size=300, num_layers=2, seed=99)
    eng = make_engine(model_dir)
    new = load_file(f"{new_dir}/model.safetensors")
    receipt = eng.update_weights(view_buckets(iter(new.items()), 1 << 20, 7), 7)
    assert receipt["version"] == 7 and receipt["tensors"] == len(dict(eng.model.named_parameters()))
    worst = {}
    for temp, sp in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=12)),
        (T, SamplingParams(temperature=T, max_tokens=12)),
    ):
        out = run(eng, reqs(seed=3), sp)
        worst[temp] = 0.0
        for r, o in zip(reqs(seed=3), out):
            assert o.weight_versions == [7] * len(o.token_ids)
            ours = trainer_logprobs(new_dir, r.prompt_ids, o.token_ids, 1.0 if temp == "greedy" else T)
            worst[temp] = max(worst[temp], float((ours - torch.tensor(o.logprobs)).abs().max()))
    print(f"max |engine - trainer| logprob after update: {worst}")
    assert max(worst.values()) <= 1e-4


def test_seeds_decide_samples_not_batching(engine, model_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a, b = run(engine, reqs(seed=1), sp), run(engine, reqs(seed=1), sp)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] and [x.logprobs for x in a] == [
        x.logprobs for x in b
    ], "same requests, same batching: bitwise"
    c = run(engine, reqs(seed=2), sp)
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # the same requests split over two engines (different batch shapes and padding): the same samples
    other = make_engine(model_dir, max_num_seqs=3)
    half = len(reqs(seed=1)) // 2
    split = run(engine, reqs(seed=1)[:half], sp) + run(other, reqs(seed=1)[half:], sp)
    assert [x.token_ids for x in split] == [x.token_ids for x in a]
    diff = max(abs(p - q) for x, y in zip(split, a) for p, q in zip(x.logprobs, y.logprobs))
    print(f"split over 2 engines: same tokens; max logprob difference {diff:.1e} (batch-shape rounding)")
    assert diff <= 1e-5


def test_top_k_and_top_p_logprobs_are_the_truncated_distribution(engine):
    sp = SamplingParams(temperature=T, top_k=5, top_p=0.9, max_tokens=12)
    out = run(engine, reqs(seed=1, n=3, prompts=PROMPTS[:1]), sp)
    for c in out:
        ids = PROMPTS[0] + c.token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, len(PROMPTS[0]) - 1 : -1].float() / T
        for j, tok in enumerate(c.token_ids):  # reference: keep top 5, then the smallest set reaching 0.9
            top = torch.topk(torch.softmax(logits[j], -1), 5)
            q = top.values / top.values.sum()
            keep = (q.cumsum(0) - q) < 0.9
            kept = top.indices[keep]
            assert tok in kept.tolist()
            ref = torch.log(q[keep] / q[keep].sum())[kept.tolist().index(tok)]
            assert abs(float(ref) - c.logprobs[j]) <= 1e-5
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.allclose(processed_logprobs(x, 1.0), torch.log_softmax(x, -1))


def _named(engine, scale=1.0):
    return [(n, p.detach() * scale) for n, p in engine.model.named_parameters()]


def test_update_is_all_or_nothing(model_dir):
    engine = make_engine(model_dir)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version = engine.version
    full = _named(engine, 1.5)
    cases = {
        "missing": full[:-1],
        "unknown": full + [("model.layers.0.extra.weight", torch.zeros(3))],
        "twice": full + full[:1],
        "shape": full[:-1] + [(full[-1][0], full[-1][1][:-1])],
    }
    for what, items in cases.items():
        for buckets in (
            make_buckets(iter(items), 64 << 10, version + 1, checksum=True),
            view_buckets(iter(items), 64 << 10, version + 1),
        ):
            with pytest.raises(BucketError) as e:
                engine.update_weights(buckets, version + 1)
            assert "engine hf" in str(e.value), what
            assert engine.version == version, f"{what}: the version must not move"
            assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters()), f"{what}: moved"
    receipt = engine.update_weights(make_buckets(iter(full), 64 << 10, version + 1, checksum=True), version + 1)
    assert engine.version == version + 1 and receipt["tensors"] == len(full) and len(receipt["digests"]) > 1
    assert all(torch.equal(before[n] * 1.5, p) for n, p in engine.model.named_parameters())


def test_a_requests_own_max_tokens_limits_it_alone(engine):
    """A data row's max_tokens: the request stops there (finish "length"), the others go to the sampling's limit,
    and each keeps the tokens it would have drawn anyway (its own seeded stream)."""
    from dataclasses import replace

    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    base = reqs(seed=4)
    limited = [replace(r, max_tokens=(3 if i % 2 else 20)) for i, r in enumerate(base)]
    full, got = run(engine, base, sp), run(engine, limited, sp)
    assert [len(o.token_ids) for o in got] == [20 if i % 2 == 0 else 3 for i in range(len(base))]
    assert all(o.finish_reason == "length" for o in got)
    for i, (a, b) in enumerate(zip(full, got)):
        n = min(len(a.token_ids), len(b.token_ids))
        assert a.token_ids[:n] == b.token_ids[:n], f"request {i}: its own stream, whatever the others' limits"


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero():
    """200k draws from a truncated distribution (zeros inside and at both ends): every frequency within 5
    standard errors of its probability, and no token of probability 0 drawn, u = 0 included. Negative controls:
    slightly biased uniforms (u ** 1.1) fail the frequency check, and the boundary on the other side
    (`right=False`) draws token 0, whose probability is 0, at u = 0."""
    probs = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.05, 0.45, 0.0, 0.2, 0.0])
    rows = probs.repeat(200_000, 1)
    draws = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    se = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()

    def worst(picked):  # the largest |frequency - probability| in standard errors (zeros: any draw fails)
        freq = torch.bincount(picked, minlength=len(probs)).double() / len(picked)
        if (freq[probs == 0] > 0).any():
            return float("inf")
        return float(((freq - probs.double()).abs() / se.clamp_min(1e-12))[probs > 0].max())

    assert worst(inverse_cdf(rows, draws)) <= 5
    assert worst(inverse_cdf(rows, draws**1.1)) > 5, "negative control: a biased sampler must fail"
    assert inverse_cdf(probs[None], torch.zeros(1)).tolist() == [1]
    cdf = probs.cumsum(-1)[None]
    assert torch.searchsorted(cdf, torch.zeros(1, 1), right=False).tolist() == [[0]], "negative control"


def test_a_prompt_asked_n_times_is_prefilled_once_and_samples_as_if_alone(engine, model_dir, monkeypatch):
    """4 prompts x 3 samples: the first forward has 4 rows (one per distinct prompt) and every sample's tokens
    and logprobs equal those of the same request run alone (an engine of one row per batch: no sharing), logprobs
    within 1e-5 (batch-shape rounding). Negative control: the shared prefill's KV rows handed out in the wrong
    order give other samples."""
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    requests = reqs(seed=5, n=3)
    first_rows = []
    hook = engine.model.register_forward_pre_hook(
        lambda m, args, kw: first_rows.append(kw["input_ids"].shape) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    try:
        shared = run(engine, requests, sp)
    finally:
        hook.remove()
    assert [s[0] for s in first_rows] == [len(PROMPTS)], first_rows
    alone = run(make_engine(model_dir, max_num_seqs=1), requests, sp)
    assert [o.token_ids for o in shared] == [o.token_ids for o in alone]
    diff = max(abs(p - q) for x, y in zip(shared, alone) for p, q in zip(x.logprobs, y.logprobs))
    print(f"shared prefill vs one request per batch: same tokens, max logprob difference {diff:.1e}")
    assert diff <= 1e-5
    from transformers.cache_utils import Cache

    reorder = Cache.reorder_cache
    monkeypatch.setattr(Cache, "reorder_cache", lambda self, rows: reorder(self, rows.roll(3)))
    assert [o.token_ids for o in run(engine, requests, sp)] != [o.token_ids for o in shared], "negative control"


def test_gqa_attention_without_repeated_kv_equals_hfs_sdpa_and_eager(engine, model_dir):
    """The engine's attention (KV heads grouped by torch's kernel, not copied) gives, on a left-padded batch with
    a mask and on a cached decode step, the logits of the same model on HF's own sdpa and eager attention (1e-5).
    Negative control: the KV heads handed over in the wrong order differ by far more."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.masking_utils import sdpa_mask

    from mgrpo.rollout.engines.hf import GQA_SDPA, sdpa_without_repeated_kv

    assert engine.model.config._attn_implementation == GQA_SDPA
    assert engine.model.model.layers[0].self_attn.num_key_value_groups > 1

    def logits(model):
        ids = torch.tensor([[0, 0, 5, 17, 42, 9], [3, 3, 3, 250, 11, 8]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            nxt = model(
                input_ids=torch.tensor([[7], [9]]),
                attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                position_ids=pos[:, -1:] + 1,
                past_key_values=out.past_key_values,
            )
        return torch.cat([out.logits[0, 2:], out.logits[1], nxt.logits[:, -1]])

    ours = logits(engine.model)
    for impl in ("sdpa", "eager"):
        ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl).eval()
        diff = float((ours - logits(ref)).abs().max())
        print(f"engine attention vs HF {impl}: max logit difference {diff:.1e}")
        assert diff <= 1e-5, impl
    AttentionInterface.register(
        "wrong_kv_order", lambda m, q, k, v, *a, **kw: sdpa_without_repeated_kv(m, q, k.flip(1), v.flip(1), *a, **kw)
    )
    AttentionMaskInterface.register("wrong_kv_order", sdpa_mask)
    wrong = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="wrong_kv_order").eval()
    assert float((ours - logits(wrong)).abs().max()) > 1e-3, "negative control"


def test_the_reserved_kv_cache_samples_as_hfs_dynamic_cache(engine, monkeypatch):
    """The engine writes keys and values into buffers reserved once per batch (`reserved_cache`: no
    concatenation of the whole cache at every decode step). A left-padded batch of 3 prompts x 2 samples, 24
    tokens, gives the tokens and logprobs of the same engine on HF's `DynamicCache` (1e-6). Negative control: the
    reserved cache with its prompt rows handed out in the wrong order gives other samples."""
    from transformers.cache_utils import DynamicLayer

    import mgrpo.rollout.engines.hf as hf

    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    requests = reqs(seed=11, n=2, prompts=PROMPTS[:3])
    layers = []
    hook = engine.model.register_forward_hook(lambda m, a, out: layers.append(type(out.past_key_values.layers[0])))
    try:
        reserved = run(engine, requests, sp)
    finally:
        hook.remove()
    assert layers[0] is not DynamicLayer and issubclass(layers[0], DynamicLayer), layers[0]
    monkeypatch.setattr(engine, "_full_attention", False)  # HF's own cache class
    dynamic = run(engine, requests, sp)
    assert [o.token_ids for o in reserved] == [o.token_ids for o in dynamic]
    diff = max(abs(p - q) for x, y in zip(reserved, dynamic) for p, q in zip(x.logprobs, y.logprobs))
    print(f"reserved vs HF's dynamic KV cache: same tokens, max logprob difference {diff:.1e}")
    assert diff <= 1e-6
    monkeypatch.setattr(engine, "_full_attention", True)
    real = hf.reserved_cache

    def rolled(capacity):
        cache = real(capacity)
        reorder = cache.reorder_cache
        cache.reorder_cache = lambda rows: reorder(rows.roll(1))
        return cache

    monkeypatch.setattr(hf, "reserved_cache", rolled)
    assert [o.token_ids for o in run(engine, requests, sp)] != [o.token_ids for o in reserved], "negative control"
