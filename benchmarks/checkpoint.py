"""Checkpoint size, save time and resume time, side by side: synchronous save vs megatron's async save (how long
the training loop waits), at the tiny model and at a ~100M-parameter Qwen2-style model. Each run is the launcher
itself: 2 GRPO steps, a checkpoint after each, then a resume from step 1.

    python benchmarks/checkpoint.py [--models tiny,100m]

Ends with one line: result: name=value ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": ["--model.tiny.num_layers", "4", "--model.tiny.hidden_size", "128"],
    "100m": [
        "--model.tiny.vocab_size",
        "32000",
        "--model.tiny.hidden_size",
        "640",
        "--model.tiny.num_layers",
        "12",
        "--model.tiny.num_heads",
        "10",
        "--model.tiny.num_kv_heads",
        "2",
        "--model.tiny.ffn_hidden_size",
        "1792",
    ],
}
SMALL_ROLLOUT = [
    "--rollout.n",
    "2",
    "--rollout.prompts_per_step",
    "2",
    "--rollout.max_tokens",
    "8",
    "--train.micro_batch_size",
    "4",
    "--train.steps",
    "2",
    "--checkpoint.save_interval",
    "1",
    "--logging.progress_bar",
    "false",
    "--logging.report",
    "false",
    "--logging.tensorboard",
    "false",
]


def run(root: str, model: str, name: str, *extra) -> str:
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        *MODELS[model],
        *SMALL_ROLLOUT,
        "--model.path",
        os.path.join(root, f"{model}-model"),
        "--logging.output_dir",
        os.path.join(root, name),
        "--checkpoint.save_dir",
        os.path.join(root, f"{name}-ckpt"),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode:
        sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
    return r.stderr


def meta(root: str, name: str, step: int) -> dict:
    with open(os.path.join(root, f"{name}-ckpt", f"step_{step:06d}", "mgrpo_meta.json")) as f:
        return json.load(f)


def bench(root: str, model: str) -> dict:
    run(root, model, f"{model}-sync")
    run(root, model, f"{model}-async", "--checkpoint.async_save", "true")
    log = run(root, model, f"{model}-resume", "--resume", os.path.join(root, f"{model}-sync-ckpt", "step_000001"))
    sync, asyn = meta(root, f"{model}-sync", 2), meta(root, f"{model}-async", 2)
    load = float(re.search(r"training state loaded in ([\d.]+) s", log).group(1))
    return {
        "mib": sum(sync["files"].values()) / 2**20,
        "sync_s": sync["save_seconds"],
        "async_total_s": asyn["save_seconds"],
        "async_wait_s": asyn["blocking_seconds"],
        "load_s": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,100m")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for model in args.models.split(","):
            rows[model] = bench(root, model)
    print(
        f"{'model':6} {'size MiB':>9} {'sync save s':>12} {'async: loop waits s':>20} {'async total s':>14} "
        f"{'resume load s':>14} {'wait ratio sync/async':>22}"
    )
    for model, r in rows.items():
        print(
            f"{model:6} {r['mib']:9.1f} {r['sync_s']:12.2f} {r['async_wait_s']:20.2f} {r['async_total_s']:14.2f} "
            f"{r['load_s']:14.2f} {r['sync_s'] / max(r['async_wait_s'], 1e-3):22.2f}"
        )
    print("result: " + " ".join(f"{m}_{k}={v:.3g}" for m, r in rows.items() for k, v in r.items()))


if __name__ == "__main__":
    main()
