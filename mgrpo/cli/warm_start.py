"""A short supervised warm start for the tiny model on generated two-operand addition, in plain torch: it turns a
random model into one that sometimes answers `What is 23 + 45?` with `\\boxed{68}`, so that GRPO with the
`accuracy` reward has something to sharpen (examples/arith_cpu.yaml).

Problems listed in the validation file (its `a` and `b` columns) are never trained on. Prompts are encoded
exactly as the data loader does (chat template with the generation prompt); the loss covers the answer tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def answer(a: int, b: int) -> str:
    return f"\\boxed{{{a + b}}}"


def held_out_pairs(path: str) -> set:
    """(a, b) of every row of a validation file (jsonl with a and b columns); empty if there is none."""
    if not path or not os.path.isfile(path):
        return set()
    with open(path) as f:
        return {(int(r["a"]), int(r["b"])) for r in map(json.loads, filter(str.strip, f)) if "a" in r and "b" in r}


def addition_pairs(rng: random.Random, exclude: set, low: int, high: int):
    """Endless random (a, b) in [low, high]^2, never one in `exclude`."""
    if (high - low + 1) ** 2 <= len(exclude) and all(
        (a, b) in exclude for a in range(low, high + 1) for b in range(low, high + 1)
    ):
        raise ValueError(f"every problem in [{low}, {high}] is held out; nothing left to warm-start on")
    while True:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (a, b) not in exclude:
            yield a, b


def warm_start(
    model_dir: str,
    steps: int,
    exclude: set,
    low: int = 0,
    high: int = 99,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Train model_dir's weights in place on addition problems outside `exclude`; returns {loss, seconds, steps}."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from mgrpo.data.dataset import encode_prompt
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.fsutil import replace_dir

    tok = load_tokenizer(model_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup, t0, loss = min(50, steps // 10 + 1), time.perf_counter(), float("nan")

    pairs = addition_pairs(rng, exclude, low, high)

    def example():
        a, b = next(pairs)
        p = encode_prompt(tok, [{"role": "user", "content": question(a, b)}])
        return p, tok.encode(answer(a, b), add_special_tokens=False) + [tok.eos_token_id]

    for step in tqdm(
        range(steps), desc="warm start (addition SFT)", disable=not progress, leave=False, mininterval=2.0
    ):
        batch = [example() for _ in range(batch_size)]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros(batch_size, width, dtype=torch.long)
        for i, (p, r) in enumerate(batch):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        for group in opt.param_groups:  # linear warmup, cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = out.loss.item()
    parent = os.path.dirname(os.path.abspath(model_dir))
    tmp = tempfile.mkdtemp(prefix=".warm-", dir=parent)
    try:  # a copy of the folder with the new weights, swapped in whole: never half-written
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "mgrpo_warm_start.json"), "w") as f:
            json.dump({"task": "addition", "steps": steps, "loss": loss, "excluded": len(exclude)}, f)
        replace_dir(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"loss": loss, "seconds": time.perf_counter() - t0, "steps": steps}
