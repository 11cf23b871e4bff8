"""Shared by the engine tests: fixed requests, a sync call into an async engine, and the trainer's own (megatron)
forward as the reference an engine's logprobs must equal."""

import asyncio

import torch

from mgrpo.rollout.engine import request_seed
from mgrpo.rollout.types import GenerationRequest

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
