"""Reward models: a sequence-classification model from an HF folder (`AutoModelForSequenceClassification`, one
label), scoring prompt + completion rendered with the reward model's own chat template, in batches.

    from mgrpo.rewards import SequenceClassifierReward, register_reward
    register_reward("my_rm")(SequenceClassifierReward("/models/my-rm", batch_size=16))

then `reward.funcs: [my_rm]`. The model loads on first use, on the engine-owner ranks that score (CUDA if
present, else CPU, or `device=`), in eval mode with no gradients.
"""

from __future__ import annotations


class SequenceClassifierReward:
    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        device: str | None = None,
        max_length: int | None = None,
        dtype: str = "float32",
    ):
        self.path, self.batch_size, self.device, self.max_length, self.dtype = (
            path,
            batch_size,
            device,
            max_length,
            dtype,
        )
        self.model = self.tokenizer = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from mgrpo.data.tokenizer import load_tokenizer

        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(self.path)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
            .to(self.device)
            .eval()
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def text(self, sample, policy_tokenizer) -> str:
        from mgrpo.rewards.registry import completion_text

        messages = [m for m in sample.messages if m.get("role") != "assistant"] if sample.messages else []
        if sample.messages and sample.messages[-1].get("role") == "assistant":
            messages = list(sample.messages)
        else:
            messages = messages + [{"role": "assistant", "content": completion_text(sample, policy_tokenizer)}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def __call__(self, samples, tokenizer, **_):
        import torch

        if self.model is None:
            self._load()
        texts = [self.text(s, tokenizer) for s in samples]
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                )
                logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
                out += logits[:, 0].float().tolist()
        return out
