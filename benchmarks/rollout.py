"""Rollout speed: the old per-prompt `model.generate` loop vs the batched HF engine, side by side on the same
requests with fixed completion lengths (EOS ignored), at the tiny model (8 prompts x 4 samples x 32 tokens) and
at a ~100M-parameter Qwen2-style model (8 x 4 x 128 tokens). Random weights, fp32, CPU.

    .venv/bin/python benchmarks/rollout.py [--reps 2] [--skip-100m]

Ends with `result: hf_batched_speedup=X hf_batched_speedup_100m=Y` (old time / batched time, best of reps).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo.models.tiny import make_tiny_hf  # noqa: E402
from mgrpo.rollout.engine import request_seed  # noqa: E402
from mgrpo.rollout.hf_engine import HFEngine  # noqa: E402
from mgrpo.rollout.types import GenerationRequest, SamplingParams  # noqa: E402

MODELS = {
    "tiny": dict(family="qwen2", vocab_size=300, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 ffn_hidden_size=256, tokens=32),
    "100m": dict(family="qwen2", vocab_size=32000, hidden_size=640, num_layers=12, num_heads=10, num_kv_heads=2,
                 ffn_hidden_size=1792, tokens=128),
}
PROMPTS, N = 8, 4


@torch.no_grad()
def old_per_prompt(model, prompts, tokens, temperature=1.0):
    """What the HF engine did before: one generate() per prompt with its n copies, logprobs recomputed."""
    out = []
    for p in prompts:
        ids = torch.tensor([p] * N)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                             top_p=1.0, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        new = gen.sequences[:, ids.shape[1]:]
        logits = torch.stack(gen.logits, 1).float()
        out.append(torch.log_softmax(logits / temperature, -1).gather(-1, new[..., None])[..., 0])
    return out


def bench(name: str, spec: dict, reps: int, root: str) -> dict:
    spec = dict(spec)
    tokens = spec.pop("tokens")
    path = make_tiny_hf(os.path.join(root, name), seed=0, **spec)
    engine = HFEngine(path, eos_token_id=1, pad_token_id=0)
    params = sum(p.numel() for p in engine.model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(spec["vocab_size"], 300), (int(l),), generator=g).tolist()
               for l in torch.randint(8, 40, (PROMPTS,), generator=g)]
    requests = [GenerationRequest(p, request_seed(0, 0, i, j)) for i, p in enumerate(prompts) for j in range(N)]
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    times = {"old": [], "batched": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        old = old_per_prompt(engine.model, prompts, tokens)
        times["old"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        new = asyncio.run(engine.generate(requests, sp))
        times["batched"].append(time.perf_counter() - t0)
    assert all(o.shape == (N, tokens) for o in old) and all(len(r.token_ids) == tokens for r in new)
    best = {k: min(v) for k, v in times.items()}
    return {"model": name, "params_m": params / 1e6, "tokens": PROMPTS * N * tokens, **best,
            "speedup": best["old"] / best["batched"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-100m", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, spec in MODELS.items():
            if name == "100m" and args.skip_100m:
                continue
            rows.append(bench(name, spec, args.reps, root))
            r = rows[-1]
            print(f"{r['model']:>5} ({r['params_m']:.1f}M params, {r['tokens']} tokens): old per-prompt "
                  f"{r['old']:.3f} s ({r['tokens'] / r['old']:.0f} tok/s) | batched {r['batched']:.3f} s "
                  f"({r['tokens'] / r['batched']:.0f} tok/s) | speedup {r['speedup']:.2f}x", flush=True)
    by = {r["model"]: r for r in rows}
    line = f"result: hf_batched_speedup={by['tiny']['speedup']:.2f}"
    if "100m" in by:
        line += f" hf_batched_speedup_100m={by['100m']['speedup']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
