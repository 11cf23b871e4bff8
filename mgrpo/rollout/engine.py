"""The rollout `Engine` protocol, capabilities, a registry of backends (one file each in `engines/`) and
per-request seeds.

An engine takes token ids in and gives token ids, logprobs of the distribution it sampled from, finish reasons
and the weight version of every token out. Weights come in as buckets of HF-named tensors, all or nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Protocol

from mgrpo.registry import Registry
from mgrpo.rollout.types import SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the manager checks these at start, never mid-run."""

    async_generate: bool = False  # several generate() calls may be in flight at once
    sleep: bool = False  # sleep()/wake() free and restore the engine's memory
    logprobs: str = "processed"  # processed: of the distribution sampled from | raw: before temperature etc.


class Engine(Protocol):
    name: str
    capabilities: Capabilities

    async def generate(self, requests: list, sampling: SamplingParams) -> list:
        """One GenerationResponse per GenerationRequest, in order."""

    def update_weights(self, buckets: Iterable, version: int) -> dict:
        """Load HF-named tensors from buckets, all or nothing; later tokens carry `version`. Returns a receipt."""

    def health(self) -> dict: ...


# factory(cfg, model_dir, tokenizer) -> Engine; vllm and SGLang themselves are imported by their own processes
ENGINES = Registry(
    "rollout engine",
    builtins=(
        "mgrpo.rollout.engines.hf",
        "mgrpo.rollout.engines.vllm",
        "mgrpo.rollout.engines.remote",
        "mgrpo.rollout.engines.sglang",
    ),
)


def register_engine(name: str, override: bool = False):
    """`@register_engine("name")` on `factory(cfg, model_dir, tokenizer) -> Engine`."""
    return ENGINES.register(name, override=override)


def engine_names() -> list:
    return ENGINES.names()


def make_engine(cfg, model_dir: str, tokenizer, index: int = 0, devices: list | None = None) -> Engine:
    """`devices`: the physical GPUs a colocated engine may use (passed only when there are some: a factory that
    starts a process on GPUs takes `devices=`)."""
    name = cfg.rollout.engine
    factory = ENGINES.lookup(name, "rollout.engine")
    engine = factory(cfg, model_dir, tokenizer, devices=devices) if devices else factory(cfg, model_dir, tokenizer)
    engine.name = f"{name}#{index}"
    return engine


def check_capabilities(engine: Engine, cfg) -> None:
    """At start: the trainer reads the engine's logprobs as those of the sampling distribution."""
    caps = getattr(engine, "capabilities", None)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"engine {getattr(engine, 'name', engine)!r} declares no Capabilities")
    if caps.logprobs != "processed":
        raise ValueError(
            f"engine {engine.name} returns {caps.logprobs} logprobs; mgrpo needs the logprobs of the "
            f"distribution it sampled from (processed)"
        )


def in_flight_mode(rollout_cfg) -> str:
    """What a push does to the requests in flight of a vLLM engine, colocated or remote: `rollout.partial` holds
    them and continues them on the new weights (their KV cache recomputed with `rollout.recompute_kv_after_update`);
    otherwise they finish first."""
    if not rollout_cfg.partial:
        return "finish"
    return "recompute" if rollout_cfg.recompute_kv_after_update else "keep"


def truncation_warning(cfg) -> str | None:
    """Why rollout logprobs and the trainer's differ when sampling truncates the vocabulary, or None."""
    r = cfg.rollout
    if r.top_p >= 1 and not r.top_k:
        return None
    return (
        f"warning: rollout.top_p={r.top_p} / rollout.top_k={r.top_k}: the engine samples from the truncated, "
        f"renormalised distribution and reports its logprobs, while the trainer computes log_softmax(z / T) "
        f"over the whole vocabulary, so pi_old / pi_rollout is off by the probability mass kept; "
        f"rollout_is/rollout_logp_abs_diff shows the gap. RL usually samples with top_p 1 and top_k 0 "
        f"(verl's recommendation); keep truncation only with algorithm.rollout_is_mode set."
    )


def request_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed from (run seed, step, prompt index in the step's batch, sample index in its group): the
    same sample gets the same stream however requests are batched or spread over engines."""
    key = f"{run_seed}:{step}:{prompt_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
