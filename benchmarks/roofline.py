"""The machine's limits and a GRPO step's lower bound from them (a roofline), measured in the run that uses them.

Two rates, each the best of several tries on the benchmark's own threads (they move ~20% between runs an hour
apart on this machine, ../shared/CPU_FACTS.md): the fp32 GEMM rate at a training shape, and the memory bandwidth
of a streaming read of a tensor far larger than the caches. Then the step's bound, part by part:

    train    6 N (P + C) / gemm               every token through forward and backward (N: matmul parameters,
                                              lm_head included, embeddings not)
    prefill  2 N P / gemm                     the prompts, once
    decode   sum over t < T of max(2 N B / gemm, (W + B (p + t) K) / bw)
                                              B sequences decoded together: each step reads every weight once
                                              (W bytes) and the KV cache so far (K bytes per token), and computes
                                              2 N per sequence; whichever is slower bounds that step

P, C: prompt and completion tokens of the step; B: sequences; T: completion length; p: mean prompt length. The
decode term is memory-bound at these sizes (a decode step reads all weights for B tokens of work), which is why a
matmul-only "limit" asked for more than the machine can give. `efficiency = bound / measured wall step`.

    .venv/bin/python benchmarks/roofline.py [--threads 2]     # prints the rates (used by vs_trl.py, scaling.py)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_rate(threads: int, reps: int = 5) -> float:
    """FLOP/s of an fp32 GEMM at a training shape (4096 tokens x hidden 768 -> 2048), best of `reps`."""
    torch.set_num_threads(threads)
    a, b = torch.randn(4096, 768), torch.randn(768, 2048)
    return 2 * 4096 * 768 * 2048 / _best(lambda: a @ b, reps)


def bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of a streaming read (`x.sum()`) of a `gib` GiB fp32 tensor, best of `reps`."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    return x.numel() * 4 / _best(lambda: x.sum(), reps)


@dataclass
class Machine:
    gemm: float  # FLOP/s
    bw: float  # bytes/s

    @classmethod
    def measure(cls, threads: int) -> "Machine":
        return cls(gemm_rate(threads), bandwidth(threads))

    def __str__(self) -> str:
        return f"fp32 GEMM {self.gemm / 1e9:.0f} GFLOP/s, streaming read {self.bw / 1e9:.1f} GB/s"


@dataclass
class Work:
    """One step's work: `params` matmul parameters (N), `weight_bytes` read per decode step (W), KV bytes per token
    (K), `seqs` sequences decoded together (B), prompt and completion tokens in all."""

    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    seqs: int
    prompt_tokens: float
    completion_tokens: float


def bound(work: Work, m: Machine) -> dict:
    """{"train", "prefill", "decode", "step"} seconds: the step cannot take less on this machine."""
    n, b = work.params, work.seqs
    steps = max(1, round(work.completion_tokens / b))  # decode steps: the completion length
    p = work.prompt_tokens / b
    decode = 0.0
    for t in range(steps):
        memory = (work.weight_bytes + b * (p + t) * work.kv_bytes_per_token) / m.bw
        decode += max(2 * n * b / m.gemm, memory)
    out = {
        "train": 6 * n * (work.prompt_tokens + work.completion_tokens) / m.gemm,
        "prefill": 2 * n * work.prompt_tokens / m.gemm,
        "decode": decode,
    }
    out["step"] = sum(out.values())
    return out


def model_work(model_dir: str, seqs: int, prompt_tokens: float, completion_tokens: float, elem: int = 4) -> Work:
    """The Work of a step on an HF model folder (fp32 by default): N from its matmul weights, K from its config."""
    import json
    import os

    from safetensors import safe_open

    params = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2 and "embed_tokens" not in name:
                params += shape[0] * shape[1]
    c = json.load(open(os.path.join(model_dir, "config.json")))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * elem
    return Work(params, params * elem, kv, seqs, prompt_tokens, completion_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    m = Machine.measure(args.threads)
    print(f"limits on {args.threads} threads: {m}")
    print(f"result: gemm_gflops={m.gemm / 1e9:.1f} bandwidth_gbs={m.bw / 1e9:.1f}")


if __name__ == "__main__":
    main()
