"""Prompts in, `Sample`s grouped by prompt out (one group of n per prompt)."""
from __future__ import annotations

import asyncio

from mgrpo.data.dataset import encode_prompt
from mgrpo.rollout.types import Sample, SamplingParams


class RolloutManager:
    def __init__(self, engine, tokenizer, cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg

    def generate(self, rows: list, step: int, version: int) -> list:
        r = self.cfg.rollout
        prompts = [encode_prompt(self.tokenizer, row["messages"], self.cfg.data.apply_chat_template) for row in rows]
        sampling = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_tokens=r.max_tokens,
                                  seed=self.cfg.train.seed * 100003 + step)
        groups = asyncio.run(self.engine.generate(prompts, sampling))
        samples = []
        for i, (row, prompt, completions) in enumerate(zip(rows, prompts, groups)):
            extra = {k: v for k, v in row.items() if k != "messages"}
            for c in completions:
                samples.append(Sample(prompt_ids=list(prompt), response_ids=list(c.token_ids),
                                      loss_mask=[1] * len(c.token_ids), rollout_logprobs=list(c.logprobs),
                                      group_id=step * len(rows) + i, weight_version=version,
                                      finish_reason=c.finish_reason, messages=row["messages"], info=dict(extra)))
        return samples
