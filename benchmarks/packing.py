"""Sequence packing: padding fraction and train time (forward + backward of one generation batch) of the padded path
against the packed one, on a batch whose lengths spread from 16 to 512 tokens, with the loss and gradient difference.
Also micro-batches by token budget, padded and packed. One process (TP1), fp32, CPU; ~20M-parameter Qwen2.

    .venv/bin/python benchmarks/packing.py [--reps 3] [--samples 32]

Ends with `result: padding_frac_padded=... padding_frac_packed=... packed_speedup=... max_grad_diff=...`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def samples_16_to_512(n: int, seed: int = 0) -> list:
    from mgrpo.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        total = int(16 * (32 ** torch.rand((), generator=g)))  # log-uniform over 16..512
        prompt = torch.randint(3, 8000, (max(4, total // 4),), generator=g).tolist()
        resp = torch.randint(3, 8000, (total - len(prompt),), generator=g).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * len(resp), group_id=i // 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_PORT", "29517")
    from mgrpo.actor import Actor
    from mgrpo.config import ParallelConfig, load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.data.packing import budget_groups, model_inputs
    from mgrpo.loss.aggregation import token_weights
    from mgrpo.loss.policy import aggregation_of
    from mgrpo.models.tiny import make_tiny_hf
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel

    init_distributed()
    setup_model_parallel(ParallelConfig())
    samples = samples_16_to_512(args.samples)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    real = sum(lengths)
    with tempfile.TemporaryDirectory() as work:
        model = make_tiny_hf(
            os.path.join(work, "m"),
            vocab_size=8192,
            hidden_size=512,
            num_layers=6,
            num_heads=8,
            num_kv_heads=2,
            ffn_hidden_size=1408,
            seed=0,
        )
        actors = {}
        for packed in (False, True):  # the padded path as before (megatron's attention), the packed one (ours)
            cfg = load_config(argv=["--model.path", model, "--data.path", "unused.jsonl"], check_files=False)
            cfg.train.sequence_packing = packed
            actors[packed] = Actor(cfg, model)
        weights = token_weights(samples, aggregation_of(cfg.algorithm), 512)
        advs = [float(i % 3) - 1.0 for i in range(len(samples))]
        ways = {
            "padded, 8 per micro-batch": (False, None),
            "packed, 8 per row": (True, None),
            "padded, 4096-token budget": (False, budget_groups(lengths, 4096, False)),
            "packed, 4096-token budget": (True, budget_groups(lengths, 4096, True)),
        }
        rows, grads = {}, {}
        for name, (packed, groups) in ways.items():
            actor = actors[packed]
            mbs = make_microbatches(samples, 8, 0, advs, token_weights=weights, groups=groups, packing=packed)
            run = sum(model_inputs(mb)[0].numel() for mb in mbs)
            times = []
            for _ in range(args.reps):
                started = time.perf_counter()
                stats = actor.forward_backward(mbs)
                times.append(time.perf_counter() - started)
            grads[name] = {n: p.main_grad.clone() for n, p in actor.chunks[0].named_parameters()}
            rows[name] = (len(mbs), run, 1 - real / run, min(times), sum(float(s["loss_sum"]) for s in stats))
    ref = "padded, 8 per micro-batch"
    print(f"{args.samples} samples, {real} tokens, lengths {min(lengths)}..{max(lengths)}\n")
    print(f"{'':28} {'micro-b':>7} {'tokens run':>10} {'padding':>8} {'train s':>8} {'speedup':>8} {'grad diff':>9}")
    worst = 0.0
    for name, (n, run, pad, t, loss) in rows.items():
        diff = max(float((grads[name][k] - grads[ref][k]).abs().max()) for k in grads[ref])
        worst = max(worst, diff)
        print(f"{name:28} {n:7d} {run:10d} {pad:8.1%} {t:8.2f} {rows[ref][3] / t:7.2f}x {diff:9.1e}")
    best = max(rows[k][3] and rows[ref][3] / rows[k][3] for k in rows if k.startswith("packed"))
    print(
        f"result: padding_frac_padded={rows[ref][2]:.3f} padding_frac_packed={rows['packed, 8 per row'][2]:.3f} "
        f"packed_speedup={rows[ref][3] / rows['packed, 8 per row'][3]:.2f} best_speedup={best:.2f} "
        f"max_grad_diff={worst:.1e}"
    )


if __name__ == "__main__":
    main()
