"""A scripted engine for scheduler logic tests only (never counted as an engine test): each turn's text comes
from `script(uuid, turn, prompt_ids)`, encoded with the tokenizer; logprobs are a fixed function of the token."""

import asyncio

from mgrpo.rollout.engine import Capabilities
from mgrpo.rollout.types import GenerationResponse


def fake_logprob(token: int) -> float:
    return -0.01 * (token % 97 + 1)


class ScriptedEngine:
    name = "scripted#0"

    def __init__(self, tokenizer, script, async_generate=True, delay=0.0):
        self.tok, self.script, self.delay = tokenizer, script, delay
        self.capabilities = Capabilities(async_generate=async_generate)
        self.requests, self.inflight, self.peak, self.calls = [], 0, 0, 0

    async def generate(self, requests, sampling):
        self.calls += 1
        self.inflight += len(requests)
        self.peak = max(self.peak, self.inflight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            out = []
            for r in requests:
                uuid, turn = r.request_id.rsplit("-t", 1)
                self.requests.append((uuid, int(turn), list(r.prompt_ids)))
                text = self.script(uuid, int(turn), list(r.prompt_ids))
                stop = not text.endswith("~")  # a trailing ~ means "ran out of tokens"
                ids = self.tok.encode(text.rstrip("~"), add_special_tokens=False)[: sampling.max_tokens]
                if stop and len(ids) < sampling.max_tokens:
                    ids.append(self.tok.eos_token_id)
                    reason = "stop"
                else:
                    reason = "length"
                out.append(GenerationResponse(ids, [fake_logprob(t) for t in ids], reason, [3] * len(ids)))
            return out
        finally:
            self.inflight -= len(requests)
