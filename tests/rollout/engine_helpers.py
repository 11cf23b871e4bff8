"""Shared by the engine tests: fixed requests, a sync call into an async engine, and the trainer's own (megatron)
forward as the reference an engine's logprobs must equal."""

import asyncio
import threading
import time

import torch

from mgrpo.rollout.engine import request_seed
from mgrpo.rollout.types import GenerationRequest, SamplingParams

# mixed prompt lengths: a batch is left-padded to the longest (HF) or scheduled unevenly (vLLM)
PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 3, 3, 250, 11], [8, 9], [41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]


def reqs(seed=0, n=2, prompts=PROMPTS):
    return [
        GenerationRequest(p, request_seed(seed, 0, i, j), f"{i}-{j}") for i, p in enumerate(prompts) for j in range(n)
    ]


def run(engine, requests, sp):
    return asyncio.run(engine.generate(requests, sp))


_ACTORS = {}


def trainer_actor(model_dir: str, temperature: float = 1.0):
    from mgrpo.actor import Actor
    from mgrpo.config import load_config

    key = (model_dir, temperature)
    if key not in _ACTORS:
        cfg = load_config(
            argv=["--model.path", model_dir, "--rollout.temperature", str(temperature)], check_files=False
        )
        _ACTORS[key] = Actor(cfg, model_dir, train=False)
    return _ACTORS[key]


def trainer_logprobs(model_dir: str, prompt: list, response: list, temperature: float) -> torch.Tensor:
    """log_softmax(z / T) of `response` after `prompt` from a megatron Actor loaded from `model_dir`."""
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.rollout.types import Sample

    actor = trainer_actor(model_dir, temperature)
    s = Sample(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response))
    mb = make_microbatches([s], 1, 0)[0]
    return actor.logprobs([mb])[0][mb["loss_mask"].bool()]


def worst_diff(outs, requests, model_dir, temperature):
    """Largest |engine - trainer| logprob over the returned tokens of every request."""
    worst = 0.0
    for r, o in zip(requests, outs):
        if not o.token_ids:  # interrupted before its first token
            continue
        ours = trainer_logprobs(model_dir, r.prompt_ids, o.token_ids, temperature)
        worst = max(worst, float((ours - torch.tensor(o.logprobs)).abs().max()))
    return worst


def diffs_after_push(engine, version, model_dir, temperature):
    """Greedy and seeded sampling at `temperature` after a push of `model_dir`'s weights: every token carries
    `version`; returns {label: largest |engine - trainer| logprob}."""
    from mgrpo.rollout.types import SamplingParams

    worst = {}
    for label, sp, temp in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=12), 1.0),
        (f"T={temperature}", SamplingParams(temperature=temperature, max_tokens=12), temperature),
    ):
        out = run(engine, reqs(seed=3), sp)
        assert all(o.weight_versions == [version] * len(o.token_ids) and o.token_ids for o in out)
        worst[label] = worst_diff(out, reqs(seed=3), model_dir, temp)
    return worst


def partial_push(engine, push, dirs, in_flight: str, temperature: float = 0.7, max_tokens: int = 96) -> tuple:
    """A push of `other` (`push(engine, model_dir, items=...)` -> (receipt, version)) while 16 requests of `max_tokens` generate
    on `new`, with the engine's `in_flight` mode (rollout.partial). Returns (requests, responses, old version, new
    version, the receipt).

    The push must land while all 16 are in flight, and before a quarter of them end: on a loaded 2-core machine the
    responses sometimes end before vLLM's pause takes hold (the receipt holds fewer, or no response spans the two
    versions). That is a lost race of the setup, not a finding: it is tried again, at most three times, and the
    caller's assertions see the last try."""
    from mgrpo.weights.export import export_hf

    # exported before generation starts: building the trainer's actor takes longer than a short response
    items = [(n, t.clone()) for n, t in export_hf(trainer_actor(dirs["other"]).models(), dst=0, bucket_bytes=1 << 20)]
    many = reqs(seed=8, n=4)
    for attempt in range(3):
        _, old = push(engine, dirs["new"])
        run(engine, reqs(seed=8, n=1), SamplingParams(temperature=temperature, max_tokens=4))  # the first call after
        result = {}  # a push is slow (vLLM warms up): the boundary must fall mid-response
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        worker = threading.Thread(target=lambda: result.update(out=run(engine, many, sp)))
        engine.in_flight = in_flight
        try:
            worker.start()
            deadline = time.time() + 60
            while engine.stats()["requests_inflight"] < len(many) and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(0.15)  # some tokens on the old weights
            receipt, new = push(engine, dirs["other"], items=items)
            worker.join(timeout=120)
        finally:
            engine.in_flight = "finish"
        spanning = sum(len(set(o.weight_versions)) > 1 for o in result["out"])
        if receipt["held_requests"] == len(many) and spanning >= len(many) // 4:
            break
        print(
            f"partial push try {attempt + 1}: {receipt['held_requests']} of {len(many)} held, {spanning} span both "
            f"versions (the responses won the race)"
        )
    return many, result["out"], old, new, receipt


def per_version_diffs(requests, outs, dirs, old, new, temperature: float) -> tuple:
    """(largest |engine - trainer| over tokens of the old version, over tokens of the new one, how many responses
    span both): each token against the trainer's forward with the weights of the version that sampled it."""
    worst_old, worst_new, spanning = 0.0, 0.0, 0
    for r, o in zip(requests, outs):
        versions = torch.tensor(o.weight_versions)
        b = int((versions == old).sum())
        assert o.weight_versions == [old] * b + [new] * (len(o.token_ids) - b), "versions change once, in order"
        spanning += 0 < b < len(o.token_ids)
        got = torch.tensor(o.logprobs)
        for model, part, lo, hi in (("new", "old", 0, b), ("other", "new", b, len(o.token_ids))):
            if hi > lo:
                ref = trainer_logprobs(dirs[model], r.prompt_ids, o.token_ids, temperature)[lo:hi]
                d = float((ref - got[lo:hi]).abs().max())
                worst_old, worst_new = (
                    (max(worst_old, d), worst_new) if part == "old" else (worst_old, max(worst_new, d))
                )
    return worst_old, worst_new, spanning


def interrupted(engine, requests, sp, after_s: float = 0.3) -> tuple:
    """`requests` generating on the engine, interrupted `after_s` after all of them are in: (responses, the
    receipt)."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=run(engine, requests, sp)))
    worker.start()
    deadline = time.time() + 60
    while engine.stats()["requests_inflight"] < len(requests) and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(after_s)  # some tokens, far from the budget
    receipt = engine.interrupt()
    worker.join(timeout=120)
    return result["out"], receipt
