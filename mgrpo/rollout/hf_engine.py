"""CPU default engine: HF transformers forward passes with our own sampling loop, so the distribution sampled
from is exactly mgrpo's rollout settings (temperature, top-k, top-p) and nothing else.

`model.generate()` would also apply the model folder's `generation_config.json` (repetition penalty, top-k, ...)
while we returned `log_softmax(logits / T)`: the logprobs would not be those of the tokens' real distribution.
Each prompt is expanded n times and sampled as one unpadded batch with a KV cache, so no padding or position-id
subtleties enter the logprobs.
"""
from __future__ import annotations

import time

import torch

from mgrpo.resharding.bucket import ManifestCheck, _dtype_name as dtype_name
from mgrpo.rollout.engine import Completion
from mgrpo.rollout.types import SamplingParams


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log of the distribution sampled from: softmax(logits / T) restricted to the top-k tokens and to the
    smallest set whose probability reaches top_p, renormalised (-inf outside). vLLM's `processed_logprobs`."""
    x = logits.float() / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the set already reached top_p (the first stays)
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, -1)


class HFEngine:
    capabilities = {"async": False, "sleep": False, "logprobs": "processed"}

    def __init__(self, model_dir: str, eos_token_id: int, pad_token_id: int, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.eos, self.pad = eos_token_id, pad_token_id
        self.version = 0
        self._params = dict(self.model.named_parameters())  # a tied lm_head is not listed separately
        self._expected = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in self._params.items()}
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._optional = ("lm_head.weight",) if tied and "lm_head.weight" not in self._params else ()

    @torch.no_grad()
    def _sample(self, prompt: list, sp: SamplingParams, generator: torch.Generator) -> list:
        ids = torch.tensor([prompt] * sp.n, dtype=torch.long)
        out = self.model(input_ids=ids, use_cache=True)
        tokens, logps = [], []
        done = torch.zeros(sp.n, dtype=torch.bool)
        for _ in range(sp.max_tokens):
            dist = processed_logprobs(out.logits[:, -1], sp.temperature, sp.top_k, sp.top_p)
            nxt = torch.multinomial(dist.exp(), 1, generator=generator)[:, 0]
            tokens.append(nxt)
            logps.append(dist.gather(-1, nxt[:, None])[:, 0])
            done |= nxt == self.eos
            if bool(done.all()):
                break
            out = self.model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        rows, lps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
        completions = []
        for row, lp in zip(rows, lps):
            end = row.index(self.eos) + 1 if self.eos in row else len(row)
            completions.append(Completion(row[:end], lp[:end], "stop" if self.eos in row[:end] else "length"))
        return completions

    async def generate(self, prompts: list, sampling: SamplingParams) -> list:
        """For each prompt, sampling.n Completions; prompt i draws from its own generator seeded from the seed."""
        return [self._sample(p, sampling, self.prompt_generator(sampling.seed, i)) for i, p in enumerate(prompts)]

    @staticmethod
    def prompt_generator(seed, index: int) -> torch.Generator:
        """The generator prompt `index` of a request with `seed` draws from (same seed, same samples)."""
        g = torch.Generator()
        g.manual_seed(((seed or 0) * 1_000_003 + index) % (1 << 63))
        return g

    @torch.no_grad()
    def update_weights(self, buckets, version: int) -> dict:
        """All or nothing: every bucket is checked (digest where it has one, and the manifest against this
        model: nothing unknown, nothing twice, right shapes and dtypes, nothing left out) before one tensor is
        copied, so a broken update leaves the served weights and version as they were."""
        check = ManifestCheck(self._expected, optional=self._optional, receiver="HF engine")
        staged = []
        for bucket in buckets:
            bucket.verify()
            check.add(bucket)
            staged.append(bucket)
        receipt = check.finish()
        for bucket in staged:
            for name, tensor in bucket.tensors():
                if name in self._params:
                    self._params[name].copy_(tensor)
        self.version = version
        return dict(receipt, version=version)

    @torch.no_grad()
    def score(self, prompt: list, response: list, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced logprobs of `response` after `prompt` (used to check weight sync)."""
        ids = torch.tensor([prompt + response])
        logits = self.model(ids).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]

    def health(self) -> dict:
        return {"ok": True, "engine": "hf", "version": self.version, "time": time.time()}
