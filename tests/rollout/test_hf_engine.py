"""The HF engine samples from exactly mgrpo's rollout settings and returns that distribution's logprobs, whatever
the model folder's generation_config.json says; and a weight update is all or nothing."""
import asyncio
import json
import shutil

import pytest
import torch

from mgrpo.resharding.bucket import BucketError, make_buckets
from mgrpo.rollout.hf_engine import HFEngine, processed_logprobs
from mgrpo.rollout.types import SamplingParams

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


@pytest.fixture(scope="module")
def engine(model_dir):
    from mgrpo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    return HFEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 3, 3, 250, 11]]


def _reference_sample(model, prompt, sp, gen):
    """Independent sampler: a full forward of the growing sequence (no KV cache) per token, softmax(logits / T)."""
    ids, toks = list(prompt), []
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(torch.multinomial(torch.softmax(logits / sp.temperature, -1)[None], 1, generator=gen)[0, 0])
        toks.append(tok)
        ids.append(tok)
    return toks


def test_samples_ignore_generation_config(engine):
    """With n=1 and no EOS cut, the engine's tokens equal an independent plain-softmax sampler fed the same
    generator: nothing from generation_config.json (penalty 1.3, top-k 5, T=2) entered the distribution."""
    engine.eos = -1  # never stop early, so every step draws
    try:
        sp = SamplingParams(n=1, temperature=T, top_p=1.0, max_tokens=24, seed=11)
        out = asyncio.run(engine.generate(PROMPTS, sp))
        for i, prompt in enumerate(PROMPTS):
            ref = _reference_sample(engine.model, prompt, sp, HFEngine.prompt_generator(11, i))
            assert out[i][0].token_ids == ref
        outside = sum(t not in torch.topk(engine.model(torch.tensor([PROMPTS[0] + out[0][0].token_ids[:j]])).logits[
            0, -1], 5).indices.tolist() for j, t in enumerate(out[0][0].token_ids))
        assert outside > 0, "top_k=5 from generation_config.json must not apply"
    finally:
        engine.eos = engine.model.config.eos_token_id


def test_logprobs_equal_the_trainers_forward(single_rank, engine, model_dir):
    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.rollout.types import Sample

    sp = SamplingParams(n=4, temperature=T, top_p=1.0, max_tokens=24, seed=5)
    out = asyncio.run(engine.generate(PROMPTS, sp))
    cfg = load_config(argv=["--model.path", model_dir, "--rollout.temperature", str(T)], check_files=False)
    actor = Actor(cfg, model_dir, train=False)
    worst = 0.0
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            s = Sample(prompt_ids=prompt, response_ids=c.token_ids, loss_mask=[1] * len(c.token_ids))
            mb = make_microbatches([s], 1, 0)[0]
            ours = actor.logprobs([mb])[0][mb["loss_mask"].bool()]
            worst = max(worst, float((ours - torch.tensor(c.logprobs)).abs().max()))
    print(f"max |engine - trainer| logprob at T={T}: {worst:.2e}")
    assert worst <= 1e-4


def test_top_k_and_top_p_logprobs_are_the_truncated_distribution(engine):
    sp = SamplingParams(n=3, temperature=T, top_k=5, top_p=0.9, max_tokens=12, seed=1)
    out = asyncio.run(engine.generate(PROMPTS[:1], sp))[0]
    for c in out:
        ids = PROMPTS[0] + c.token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, len(PROMPTS[0]) - 1: -1].float() / T
        for j, tok in enumerate(c.token_ids):  # reference: keep top 5, then the smallest set reaching 0.9
            p = torch.softmax(logits[j], -1)
            top = torch.topk(p, 5)
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


def test_update_is_all_or_nothing(engine):
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    version = engine.version
    full = _named(engine, 1.5)
    cases = {"missing": full[:-1], "unknown": full + [("model.layers.0.extra.weight", torch.zeros(3))],
             "twice": full + full[:1], "shape": full[:-1] + [(full[-1][0], full[-1][1][:-1])]}
    for what, items in cases.items():
        with pytest.raises(BucketError) as e:
            engine.update_weights(make_buckets(iter(items), 64 << 10, version + 1, checksum=True), version + 1)
        assert "HF engine" in str(e.value), what
        assert engine.version == version, f"{what}: the version must not move"
        assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters()), f"{what}: weights moved"
    receipt = engine.update_weights(make_buckets(iter(full), 64 << 10, version + 1, checksum=True), version + 1)
    assert engine.version == version + 1 and receipt["tensors"] == len(full) and len(receipt["digests"]) > 1
    assert all(torch.equal(before[n] * 1.5, p) for n, p in engine.model.named_parameters())
    engine.update_weights(make_buckets(iter(_named(engine, 1 / 1.5)), 64 << 10, version + 2, checksum=False),
                          version + 2)
