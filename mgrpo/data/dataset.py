"""Prompt datasets from local jsonl files: a `prompt` string or a `messages` chat list per row."""
from __future__ import annotations

import json
import os
import random


class DatasetError(ValueError):
    """A dataset file or row we cannot use; the message names the file, row and fix."""


def read_prompt_rows(path: str, prompt_key: str = "prompt", messages_key: str = "messages") -> list:
    """Rows as dicts with a `messages` list; other columns pass through unchanged."""
    if not os.path.isfile(path):
        raise DatasetError(f"data.path={path!r}: file not found")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: row {i} is not valid JSON ({exc.msg}); fix or remove the line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: row {i} is not a JSON object")
            if isinstance(row.get(messages_key), list) and row[messages_key]:
                messages = row[messages_key]
            elif isinstance(row.get(prompt_key), str) and row[prompt_key].strip():
                messages = [{"role": "user", "content": row[prompt_key]}]
            else:
                raise DatasetError(f"{path}: row {i} has no prompt: add a non-empty '{prompt_key}' string or a "
                                   f"'{messages_key}' list (or set data.prompt_key)")
            extra = {k: v for k, v in row.items() if k not in (prompt_key, messages_key)}
            rows.append({"messages": messages, **extra})
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def encode_prompt(tokenizer, messages: list, apply_chat_template: bool = True) -> list:
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


class PromptStream:
    """Endless, epoch-shuffled batches of prompt rows; deterministic for a seed."""

    def __init__(self, rows: list, batch_size: int, shuffle: bool = True, seed: int = 0):
        self.rows, self.batch_size, self.shuffle = rows, batch_size, shuffle
        self.rng = random.Random(seed)
        self.order, self.pos = [], 0

    def next_batch(self) -> list:
        batch = []
        while len(batch) < self.batch_size:
            if self.pos >= len(self.order):
                self.order = list(range(len(self.rows)))
                if self.shuffle:
                    self.rng.shuffle(self.order)
                self.pos = 0
            batch.append(self.rows[self.order[self.pos]])
            self.pos += 1
        return batch
