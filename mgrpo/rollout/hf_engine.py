"""CPU default engine: HF transformers sampling on token ids, with logprobs of the tempered distribution.

Each prompt is expanded n times and sampled as one unpadded batch, so no padding or position-id
subtleties enter the logprobs.
"""
from __future__ import annotations

import time

import torch

from mgrpo.rollout.engine import Completion
from mgrpo.rollout.types import SamplingParams


class HFEngine:
    def __init__(self, model_dir: str, eos_token_id: int, pad_token_id: int, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.eos, self.pad = eos_token_id, pad_token_id
        self.version = 0
        self._params = dict(self.model.named_parameters())
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))

    @torch.no_grad()
    def _generate_one(self, prompt: list, sp: SamplingParams) -> list:
        ids = torch.tensor([prompt] * sp.n, dtype=torch.long)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=sp.temperature, top_p=sp.top_p,
            top_k=0, max_new_tokens=sp.max_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
            output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, 1).float()  # raw logits, [n, new, V]
        logp = torch.log_softmax(logits / sp.temperature, -1).gather(-1, new[..., None])[..., 0]
        completions = []
        for row, lp in zip(new.tolist(), logp.tolist()):
            end = row.index(self.eos) + 1 if self.eos in row else len(row)
            completions.append(Completion(row[:end], lp[:end], "stop" if self.eos in row[:end] else "length"))
        return completions

    async def generate(self, prompts: list, sampling: SamplingParams) -> list:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        return [self._generate_one(p, sampling) for p in prompts]

    @torch.no_grad()
    def update_weights(self, buckets, version: int) -> None:
        """Copy every tensor of every bucket into the HF model in place (checksums verified if present)."""
        for bucket in buckets:
            if bucket.manifest.get("sha256"):
                bucket.verify()
            for name, tensor in bucket.tensors():
                if name not in self._params:
                    if name == "lm_head.weight" and self._tied:
                        continue
                    raise KeyError(f"HF engine has no parameter {name!r} ({bucket.label})")
                self._params[name].copy_(tensor)
        self.version = version

    @torch.no_grad()
    def score(self, prompt: list, response: list, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced logprobs of `response` after `prompt` (used to check weight sync)."""
        ids = torch.tensor([prompt + response])
        logits = self.model(ids).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]

    def health(self) -> dict:
        return {"ok": True, "engine": "hf", "version": self.version, "time": time.time()}
