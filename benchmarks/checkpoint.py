"""Checkpoint size, save time and resume time, side by side: synchronous save vs megatron's async save (how long
the training loop waits), at the tiny model and at a ~100M-parameter Qwen2-style model. Each run is the launcher
itself: 2 GRPO steps, a checkpoint after each, then a resume from step 1.

Then the distributed optimizer's two formats at DP2 (two ranks): the host memory each rank's save takes on top of
what it held (`save_peak_host_mib` in the checkpoint's meta, sampled while the save runs), with
`checkpoint.reshardable` false (each rank writes its own shard) and true (megatron's fully_reshardable gathers the
whole fp32 state, master weights and both Adam moments, on DP rank 0), beside that state's size.

    python benchmarks/checkpoint.py [--models tiny,100m] [--skip-formats]

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


def run(root: str, model: str, name: str, *extra, nproc: int = 1) -> str:
    torchrun = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=29533"] if nproc > 1 else []
    cmd = [
        sys.executable,
        *torchrun,
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


def formats(root: str, model: str) -> dict:
    """Per-rank save peaks (MiB) at DP2 with the distributed optimizer, both formats, and the fp32 state's MiB."""
    out = {}
    for reshardable in ("false", "true"):
        name = f"{model}-dp2-reshardable-{reshardable}"
        run(
            root,
            model,
            name,
            "--train.use_distributed_optimizer",
            "true",
            "--checkpoint.reshardable",
            reshardable,
            nproc=2,
        )
        out[reshardable] = meta(root, name, 2)["save_peak_host_mib"]
    with open(os.path.join(root, f"{model}-model", "config.json")) as f:
        c = json.load(f)
    h, layers, ffn, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (c.get("head_dim") or h // c["num_attention_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    n = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + h
    out["state_mib"] = n * 12 / 2**20  # fp32 master weights + exp_avg + exp_avg_sq
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--skip-formats", action="store_true")
    args = ap.parse_args()
    rows, fmts = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for model in args.models.split(","):
            rows[model] = bench(root, model)
            if not args.skip_formats:
                fmts[model] = formats(root, model)
    print(
        f"{'model':6} {'size MiB':>9} {'sync save s':>12} {'async: loop waits s':>20} {'async total s':>14} "
        f"{'resume load s':>14} {'wait ratio sync/async':>22}"
    )
    for model, r in rows.items():
        print(
            f"{model:6} {r['mib']:9.1f} {r['sync_s']:12.2f} {r['async_wait_s']:20.2f} {r['async_total_s']:14.2f} "
            f"{r['load_s']:14.2f} {r['sync_s'] / max(r['async_wait_s'], 1e-3):22.2f}"
        )
    result = {f"{m}_{k}": v for m, r in rows.items() for k, v in r.items()}
    if fmts:
        print(
            f"\ndistributed optimizer at DP2: host memory each rank's save adds, MiB (sampled every 5 ms)\n"
            f"{'model':6} {'fp32 state MiB':>15} {'per-rank shards: r0':>20} {'r1':>6} "
            f"{'fully_reshardable: r0':>22} {'r1':>6} {'r0 ratio':>9}"
        )
        for model, f in fmts.items():
            (a0, a1), (b0, b1) = f["false"], f["true"]
            print(
                f"{model:6} {f['state_mib']:15.1f} {a0:20.1f} {a1:6.1f} {b0:22.1f} {b1:6.1f} {b0 / max(a0, 0.1):9.2f}"
            )
            result.update(
                {
                    f"{model}_state_mib": f["state_mib"],
                    f"{model}_sharded_save_peak_r0_mib": a0,
                    f"{model}_reshardable_save_peak_r0_mib": b0,
                }
            )
    print("result: " + " ".join(f"{k}={v:.3g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
