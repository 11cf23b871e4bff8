"""The rollout `Engine` protocol: token ids in, token ids and logprobs out; weights pushed in by HF name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from mgrpo.rollout.types import SamplingParams


@dataclass
class Completion:
    token_ids: list
    logprobs: list  # of the sampling distribution: log_softmax(logits / T)
    finish_reason: str  # stop | length


class Engine(Protocol):
    async def generate(self, prompts: list, sampling: SamplingParams) -> list:
        """For each prompt (a list of token ids), `sampling.n` Completions."""

    def update_weights(self, buckets: Iterable, version: int) -> None:
        """Load HF-named full tensors from `mgrpo.resharding.bucket.Bucket`s in place; `version` is stamped
        on later samples."""

    def health(self) -> dict: ...


def make_engine(cfg, model_dir: str, tokenizer) -> "Engine":
    name = cfg.rollout.engine
    if name == "hf":
        from mgrpo.rollout.hf_engine import HFEngine

        return HFEngine(model_dir, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    raise NotImplementedError(f"rollout.engine={name!r} is not available yet in this build; use rollout.engine=hf")

