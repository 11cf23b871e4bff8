"""The currency between rollout and trainer: one `Sample` per trajectory, token ids in and out; and the
request/response types every engine speaks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass
class SamplingParams:
    """What every request of a call is sampled with; temperature 0 = greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 32
    ignore_eos: bool = False  # benchmarks: fixed completion lengths


@dataclass
class GenerationRequest:
    prompt_ids: list
    seed: int  # the request's own sampling stream (see mgrpo.rollout.engine.request_seed)
    request_id: str = ""
    max_tokens: Optional[int] = None  # this request's own limit (a data row's `max_tokens`); None: the sampling's


@dataclass
class GenerationResponse:
    token_ids: list
    logprobs: list  # of the distribution sampled from (after temperature / top-k / top-p)
    finish_reason: str  # stop | length
    weight_versions: list  # the weight version that produced each token
    served_by: str = ""  # which server of a multi-replica engine answered ("" = the engine itself)
    routed_experts: Optional[dict] = None  # MoE: the experts each input token went to (mgrpo/models/routing.py)


@dataclass
class Sample:
    prompt_ids: list
    response_ids: list = field(default_factory=list)  # flat, all turns
    loss_mask: list = field(default_factory=list)  # same length; 0 for tokens the environment wrote
    rollout_logprobs: Optional[list] = None  # log_softmax(logits / T) of each response token, or None
    reward: Optional[float] = None
    group_id: int = 0
    weight_version: int = 0
    finish_reason: str = ""  # stop | length | abort | interrupted (by a checkpoint; continued before training)
    messages: list = field(default_factory=list)
    info: dict = field(default_factory=dict)  # JSON-serialisable extras (dataset columns, per-reward scores)
    # MoE: the engine's experts for prompt + response[:-1], [tokens, moe_layers, topk] (encode_routing), or None
    routed_experts: Optional[dict] = None
    # the weight version that sampled each response token (partial rollout: a response may span versions; an
    # environment-written token carries the version of the turn before it), or None; weight_version is the oldest
    token_versions: Optional[list] = None

    def __post_init__(self):
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {len(self.response_ids)} response "
                f"tokens; they must have the same length"
            )
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError("rollout_logprobs must be None or as long as response_ids")
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError("token_versions must be None or as long as response_ids")


def sample_dict(sample: "Sample") -> dict:
    """The fields as a dict, shallow: `dataclasses.asdict` deep-copies every token list (~12 ms a step for 32
    samples of the tiny task), and the dict goes straight to JSON."""
    return {f.name: getattr(sample, f.name) for f in fields(sample)}


def samples_to_bytes(samples: list) -> bytes:
    """JSON, never pickle: samples cross process (and later network) boundaries."""
    return json.dumps([sample_dict(s) for s in samples]).encode()


def samples_from_bytes(data: bytes) -> list:
    return [Sample(**d) for d in json.loads(data.decode())]
