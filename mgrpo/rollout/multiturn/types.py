"""ms-swift's scheduler vocabulary, token in and token out: `InferRequest` (RolloutInferRequest), `ResponseChoice`
(ChatCompletionResponseChoice) and `RolloutOutput`.

The difference from ms-swift: a request also carries `prompt_ids`, the exact token context the next turn is
generated from. The run loop grows it by appending tokens (the response, then the tokens of what the scheduler
added); the message list is the text view for schedulers, environments and rewards, and is never re-templated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class InferRequest:
    """One trajectory's request: its messages (text world), dataset row (`data_dict`), a uuid, and the token
    context of its next turn (`prompt_ids`; the run loop maintains it)."""

    messages: list
    data_dict: dict = field(default_factory=dict)
    uuid: str = ""
    prompt_ids: list = field(default_factory=list)
    seed: int = 0  # the trajectory's sampling stream; turn k draws from a seed derived from (seed, k)
    turns_generated: int = 0  # engine calls made for this trajectory (derives the next turn's seed)


@dataclass
class ResponseChoice:
    """One generated turn. `message.content` is the decoded text (special tokens skipped); `logprobs` is
    ms-swift's / OpenAI's `{"content": [{"token_id", "logprob"}, ...]}`; `token_logprobs` the same as a list."""

    message: ChatMessage
    token_ids: list
    finish_reason: str  # stop | length | abort
    token_logprobs: list
    weight_version: int = 0  # the oldest of token_versions
    index: int = 0
    token_versions: list = field(default_factory=list)  # the version that sampled each token (partial rollout)

    @property
    def logprobs(self) -> dict:
        return {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(self.token_ids, self.token_logprobs)]}


@dataclass
class ChatResponse:
    """What `infer_async` returns, as ms-swift's ChatCompletionResponse: `response.choices[0]`."""

    choices: list


@dataclass
class RolloutOutput:
    """A finished trajectory. `response_token_ids`: segments (or one flat list) whose concatenation is exactly
    what followed the initial prompt, environment tokens included; `response_loss_mask` the same shape (0 for
    environment tokens); `rollout_logprobs` one logprob per mask-1 token (ms-swift's rule) in segments or flat,
    or empty when unknown."""

    messages: list
    response_token_ids: list
    response_loss_mask: list
    rollout_logprobs: list = field(default_factory=list)
    rollout_infos: dict = field(default_factory=dict)
    finish_reason: str = "stop"
    response: Optional[ChatResponse] = None
    weight_version: int = 0
    prompt_ids: Optional[list] = None  # the initial prompt when on_trajectory_start rewrote it
    token_versions: list = field(default_factory=list)  # flat, one per response token (environment: its turn's)


def flatten(parts: list) -> list:
    """Segments [[...], [...]] or an already flat list, as one flat list."""
    return [x for p in parts for x in p] if parts and isinstance(parts[0], (list, tuple)) else list(parts)
