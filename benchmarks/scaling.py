"""How a step's cost grows with the work, mgrpo against TRL 1.16, engine for engine (both HF engines), by wall clock.

At the ~85M Qwen2 of benchmarks/vs_trl.py (same prompts, reward, LR, micro-batches of 8, 4 samples per prompt):
- completion lengths 64, 128, 256, 512 tokens at 4 prompts per step;
- 4, 8, 16 prompts per step at 64-token completions.
Each point is the median wall step (vs_trl.py's outside clock: the time between two steps' lines, the first step
untimed) of both tools in the same run, beside the roofline bound of the same work (benchmarks/roofline.py, the
machine's GEMM rate and bandwidth measured at the start of the run). The exponent is the slope of log(wall step)
against log(completion tokens per step), fitted by least squares over the length sweep (and, printed beside it,
over the batch sweep). Writes `scaling.png` (log-log, both tools and the bound) and a JSON of the points.

    .venv/bin/python benchmarks/scaling.py [--steps 3] [--out docs/benchmarks] [--lengths 64,128,256,512]

Ends with `result: mgrpo_exponent=... trl_exponent=... mgrpo_batch_exponent=... trl_batch_exponent=...
bound_exponent=...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.roofline import Machine  # noqa: E402
from benchmarks.vs_trl import POLICIES, SIZES, TRL_PY, run_mgrpo, run_trl, summary  # noqa: E402
from mgrpo.models.tiny import make_tiny_hf  # noqa: E402


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of log(y) on log(x): the exponent of y in x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def plot(points: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep, title in zip(axes, ("length", "batch"), ("completion length (4 prompts)", "prompts (64 tokens)")):
        rows = sorted((p for p in points if p["sweep"] == sweep), key=lambda p: p["tokens"])
        if not rows:
            continue
        x = [p["tokens"] for p in rows]
        ax.loglog(x, [p["mgrpo"] for p in rows], "o-", label="mgrpo (HF engine)")
        ax.loglog(x, [p["trl"] for p in rows], "s-", label="TRL 1.16 (HF generate)")
        ax.loglog(x, [p["bound"] for p in rows], "k--", label="roofline bound")
        ax.set_xlabel("completion tokens per step")
        ax.set_ylabel("wall step (s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--size", default="mid", choices=sorted(SIZES), help="tiny: a quick try of the script")
    ap.add_argument("--policy", default="PASSIVE", choices=POLICIES, help="OpenMP wait policy, the same for both")
    args = ap.parse_args()
    if not os.path.exists(TRL_PY):
        raise SystemExit("TRL's venv is missing: run `bash scripts/setup.sh --with-peers`")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the first step has no line before it and is not timed")
    machine = Machine.measure(args.threads)
    print(f"limits on {args.threads} threads (measured now): {machine}")
    print("clock: wall time between two steps' lines, watched from outside, the same way for both tools")
    print(f"OpenMP wait policy, the same for both tools: {args.policy}")
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    grid = [("length", 4, t) for t in lengths] + [("batch", p, 64) for p in batches if (p, 64) != (4, lengths[0])]
    points = []
    with tempfile.TemporaryDirectory() as work:
        model = make_tiny_hf(os.path.join(work, "model"), seed=0, **SIZES[args.size]["model"])
        for sweep, prompts, tokens in grid:
            size = dict(SIZES[args.size], max_tokens=tokens)
            mine = run_mgrpo(model, size, "hf", args.steps, work, args.threads, prompts=prompts, policy=args.policy)
            peer = run_trl(model, size, args.steps, work, args.threads, prompts=prompts, policy=args.policy)
            prompt_tokens = statistics.median(mine["prompt_tokens"])
            a = summary(mine, args.warmup, model, machine, prompt_tokens, prompts=prompts)
            b = summary(peer, args.warmup, model, machine, prompt_tokens, prompts=prompts)
            done = statistics.median(mine["completion_tokens"][args.warmup :])
            p = dict(sweep=sweep, prompts=prompts, max_tokens=tokens, tokens=done)
            p.update(mgrpo=a["step"], trl=b["step"], bound=a["bound"]["step"], trl_tokens=b["tokens_per_s"] * b["step"])
            points.append(p)
            print(
                f"{sweep:6} prompts={prompts:2} max_tokens={tokens:3}  tokens/step mgrpo {done:6.0f} "
                f"TRL {p['trl_tokens']:6.0f}  wall step mgrpo {a['step']:6.2f} s  TRL {b['step']:6.2f} s  "
                f"bound {p['bound']:6.2f} s  TRL/mgrpo {b['step'] / a['step']:.2f}x",
                flush=True,
            )
        if batches and (4, lengths[0]) in [(p, 64) for p in batches]:  # the length sweep's first point is batch 4
            first = dict(next(p for p in points if p["max_tokens"] == 64 and p["prompts"] == 4), sweep="batch")
            points.append(first)
    os.makedirs(args.out, exist_ok=True)
    json.dump(points, open(os.path.join(args.out, "scaling.json"), "w"), indent=1)
    plot(points, os.path.join(args.out, "scaling.png"))
    line = {}
    for sweep, suffix in (("length", ""), ("batch", "_batch")):
        rows = [p for p in points if p["sweep"] == sweep]
        if len(rows) < 2:
            continue
        line[f"mgrpo{suffix}_exponent"] = slope([p["tokens"] for p in rows], [p["mgrpo"] for p in rows])
        line[f"trl{suffix}_exponent"] = slope([p["trl_tokens"] for p in rows], [p["trl"] for p in rows])
        line[f"bound{suffix}_exponent"] = slope([p["tokens"] for p in rows], [p["bound"] for p in rows])
    print(f"plot: {os.path.join(args.out, 'scaling.png')}")
    print("result: " + " ".join(f"{k}={v:.3f}" for k, v in line.items()))


if __name__ == "__main__":
    main()
