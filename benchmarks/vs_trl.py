"""mgrpo against TRL 1.16's GRPOTrainer on the same work, engine for engine, by wall clock, beside the machine's
limits measured in the same run (benchmarks/roofline.py).

Same model folder (random weights, fp32), prompts (examples/data/tiny_prompts.jsonl), reward (`token_fraction`:
digits), batch (8 prompts x 4 samples, one optimizer step per batch, micro-batches of 8), completion length, LR,
temperature 1 and no KL, on the same threads. Sizes: the tiny Qwen2 (2 layers, hidden 128, 32-token completions)
and an ~85M Qwen2 (12 layers, hidden 768, vocab 8192, 128-token completions). Pairs, engine for engine: mgrpo's HF
engine vs TRL's default (HF `generate`) at both sizes; at ~85M mgrpo's colocated vLLM vs TRL's colocated vLLM
(`use_vllm=True, vllm_mode="colocate"`) where TRL's venv can run it, else the pair is labelled "mgrpo-vLLM vs
TRL's default" and TRL's error is printed. TRL runs in its own venv (`bash scripts/setup.sh --with-peers`).

The clock, the same for both and from the outside: each tool writes one line per finished step (mgrpo its
metrics.jsonl, TRL a steps file from its `on_step_end`); this process polls both files every 5 ms and a step's
time is the wall time between two lines' arrivals (so logging and whatever runs between steps count, on both
sides), the median of the steps after `--warmup`. The bound is roofline.py's (training + prefill FLOPs at the
measured GEMM rate, each decode step at the slower of its FLOPs and its bytes at the measured bandwidth);
efficiency = bound / wall step, for every run.

Both tools of a pair run under the same OpenMP wait policy, named in the environment (the idle threads of libgomp
spin or sleep between parallel regions; at the tiny size that alone moves a step ~1.7x): the tiny pair under each
of PASSIVE (mgrpo's CPU default, the headline), ACTIVE (spin: fastest on a quiet machine) and "own" (each tool's
default: mgrpo PASSIVE, TRL libgomp's spin-then-sleep); the ~85M pairs under one (`--mid-policy`, PASSIVE: the
vLLM engine's worker shares the cores with the trainer, where spinning threads would steal them).

    .venv/bin/python benchmarks/vs_trl.py [--steps 6] [--warmup 2] [--skip-mid] [--skip-trl] [--policies ...]

Ends with `result: tiny_hf_speedup=... tiny_hf_speedup_active=... tiny_hf_speedup_own=... mid_hf_speedup=... mid_vllm_speedup=... mid_best_efficiency=...
trl_mid_efficiency=...` (speedup = TRL's wall step / mgrpo's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.roofline import Machine, bound, model_work  # noqa: E402
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
# libgomp's wait policy, set the same for both tools: mgrpo sets PASSIVE on CPU machines unless the environment
# names one (mgrpo/parallel/omp.py), TRL leaves libgomp's default (spin, then sleep). At the tiny size that choice
# alone moves a step ~1.7x, more than anything the tools do differently, so a pair runs under one named policy;
# "own" gives each tool its own default (what a user gets out of the box).
POLICIES = ("PASSIVE", "ACTIVE", "own")


def tool_env(threads: int, policy: str, **extra) -> dict:
    """The child's environment: its threads, and the wait policy (for "own", none: each tool picks)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "own":
        env["OMP_WAIT_POLICY"] = policy
    return env


class StepClock:
    """Polls a file that gains one line per finished step; `arrivals` holds the wall time each line was seen."""

    def __init__(self, path: str):
        self.path, self.arrivals, self.stop = path, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        seen = 0
        while not self.stop.is_set():
            try:
                with open(self.path) as f:
                    lines = sum(1 for line in f if line.endswith("\n"))
            except OSError:
                lines = 0
            now = time.perf_counter()
            self.arrivals += [now] * (lines - seen)
            seen = max(seen, lines)
            time.sleep(0.005)

    def steps(self) -> list:
        """Seconds between consecutive steps' lines (the first step has no line before it: it is not timed)."""
        self.stop.set()
        self.thread.join()
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def run_watched(cmd, env, cwd, watch: str) -> tuple:
    clock = StepClock(watch)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    return r, clock.steps()


def run_mgrpo(
    model: str,
    size: dict,
    engine: str,
    steps: int,
    work: str,
    threads: int,
    prompts: int = PROMPTS_PER_STEP,
    policy: str = "PASSIVE",
) -> dict:
    out = os.path.join(work, f"mgrpo-{engine}-{prompts}-{size['max_tokens']}-{policy}")
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
        str(prompts),
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
    r, wall = run_watched(cmd, tool_env(threads, policy), ROOT, os.path.join(out, "metrics.jsonl"))
    if r.returncode:
        raise SystemExit(f"mgrpo ({engine}) failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    n = prompts * N
    return {
        "wall_s": wall,
        "step_s": [r["timing/step"] for r in rows],
        "rollout_s": [r.get("timing/rollout", 0.0) for r in rows],
        "train_s": [r.get("timing/train", 0.0) for r in rows],
        "sync_s": [r.get("timing/sync", 0.0) for r in rows],
        "completion_tokens": [r["response_length/mean"] * n for r in rows],
        "prompt_tokens": [r["prompt_length/mean"] * n for r in rows],
        "reward": [r["reward/mean"] for r in rows],
    }


def run_trl(
    model: str,
    size: dict,
    steps: int,
    work: str,
    threads: int,
    vllm: bool = False,
    prompts: int = PROMPTS_PER_STEP,
    policy: str = "PASSIVE",
) -> dict:
    """TRL's run; with `vllm` its colocated vLLM: {"error": first line} where TRL cannot run it."""
    spec = dict(
        model=model,
        prompts=PROMPTS,
        prompts_per_step=prompts,
        n=N,
        micro_batch_size=MICRO,
        max_tokens=size["max_tokens"],
        lr=size["lr"],
        steps=steps,
        seed=1,
        threads=threads,
        workdir=os.path.join(work, "trl"),
        vllm=vllm,
        steps_file=os.path.join(work, f"trl-steps-{int(vllm)}-{prompts}-{size['max_tokens']}-{policy}.jsonl"),
    )
    path, out = os.path.join(work, "trl-spec.json"), os.path.join(work, "trl.json")
    json.dump(spec, open(path, "w"))
    env = tool_env(threads, policy, TOKENIZERS_PARALLELISM="false")
    cmd = [TRL_PY, os.path.join(ROOT, "benchmarks", "peers", "trl_grpo.py"), "--spec", path, "--out", out]
    r, wall = run_watched(cmd, env, work, spec["steps_file"])
    if r.returncode:
        last = [line for line in r.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        if vllm:
            return {"error": last[0][:300]}
        raise SystemExit(f"TRL failed:\n{r.stderr[-3000:]}")
    rec = json.load(open(out))
    rec["wall_s"] = wall
    rec["train_s"] = [s - g for s, g in zip(rec["step_s"], rec["rollout_s"])]
    return rec


def summary(
    rec: dict, warmup: int, model: str, machine: Machine, prompt_tokens: float, prompts: int = PROMPTS_PER_STEP
) -> dict:
    """Medians after warm-up of the outside wall step (`wall_s[i]` ends at step i + 1) and the phases, and the
    roofline bound of the same work."""
    k = slice(warmup, None)
    wall = rec["wall_s"][max(warmup - 1, 0) :]
    step = statistics.median(wall)
    tokens = statistics.median(rec["completion_tokens"][k])
    prompt = statistics.median(rec["prompt_tokens"][k]) if "prompt_tokens" in rec else prompt_tokens  # same prompts
    parts = bound(model_work(model, prompts * N, prompt, tokens), machine)
    return {
        "step": step,
        "inside_step": statistics.median(rec["step_s"][k]),
        "tokens_per_s": tokens / step,
        "rollout": statistics.median(rec["rollout_s"][k]),
        "train": statistics.median(rec["train_s"][k]),
        "sync": statistics.median(rec.get("sync_s", [0.0])[k] or [0.0]),
        "reward_first": rec["reward"][0] if rec["reward"] else float("nan"),
        "reward_last": rec["reward"][-1] if rec["reward"] else float("nan"),
        "bound": parts,
        "efficiency": parts["step"] / step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--skip-mid", action="store_true")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument(
        "--policies",
        default="PASSIVE,ACTIVE,own",
        help="OpenMP wait policies of the tiny pairs, each set the same for both tools (own: each tool's default)",
    )
    ap.add_argument("--mid-policy", default="PASSIVE", choices=POLICIES, help="the ~85M pairs' policy (one)")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if not policies or any(p not in POLICIES for p in policies):
        ap.error(f"--policies: a comma-separated list of {', '.join(POLICIES)} (got {args.policies!r})")
    if not args.skip_trl and not os.path.exists(TRL_PY):
        raise SystemExit("TRL's venv is missing: run `bash scripts/setup.sh --with-peers` (or pass --skip-trl)")
    machine = Machine.measure(args.threads)
    print(f"limits on {args.threads} threads (measured now): {machine}")
    print("clock: wall time between two steps' lines, watched from outside, the same way for both tools")
    print(f"OpenMP wait policy, the same for both tools of a pair: tiny {policies}, ~85M {args.mid_policy}")
    results, notes = {}, []
    for name, size in SIZES.items():
        if name == "mid" and args.skip_mid:
            continue
        with tempfile.TemporaryDirectory() as work:
            model = make_tiny_hf(os.path.join(work, "model"), seed=0, **size["model"])
            for policy in policies if name == "tiny" else [args.mid_policy]:
                runs = {"mgrpo-hf": run_mgrpo(model, size, "hf", args.steps, work, args.threads, policy=policy)}
                if not args.skip_trl:
                    runs["trl-hf"] = run_trl(model, size, args.steps, work, args.threads, policy=policy)
                if name == "mid":
                    runs["mgrpo-vllm"] = run_mgrpo(model, size, "vllm", args.steps, work, args.threads, policy=policy)
                    if not args.skip_trl:
                        rec = run_trl(model, size, args.steps, work, args.threads, vllm=True, policy=policy)
                        if "error" in rec:
                            notes.append(f"TRL's colocated vLLM did not run here: {rec['error']}")
                        else:
                            runs["trl-vllm"] = rec
                prompts = statistics.median(runs["mgrpo-hf"]["prompt_tokens"])  # TRL's record has none: the same
                for who, rec in runs.items():
                    results[(name, policy, who)] = summary(rec, args.warmup, model, machine, prompts)
    print(
        f"\n{'size':5} {'policy':7} {'run':10} {'wall s':>7} {'inside':>7} {'rollout':>8} {'train':>7} {'sync':>6} "
        f"{'tok/s':>7} {'bound s':>8} {'(train':>7} {'prefill':>8} {'decode)':>8} {'effic.':>7} "
        f"{'reward first->last':>19}"
    )
    for (name, policy, who), s in results.items():
        b = s["bound"]
        print(
            f"{name:5} {policy:7} {who:10} {s['step']:7.2f} {s['inside_step']:7.2f} {s['rollout']:8.2f} "
            f"{s['train']:7.2f} {s['sync']:6.2f} {s['tokens_per_s']:7.1f} {b['step']:8.2f} {b['train']:7.2f} "
            f"{b['prefill']:8.2f} {b['decode']:8.2f} {s['efficiency']:7.2f} {s['reward_first']:8.3f} -> "
            f"{s['reward_last']:.3f}"
        )
    for note in notes:
        print(note)
    line = {}

    def ratio(size, policy, mine, peer, key):
        if (size, policy, mine) in results and (size, policy, peer) in results:
            line[key] = results[(size, policy, peer)]["step"] / results[(size, policy, mine)]["step"]
            print(f"{size} ({policy}): {mine} vs {peer}: {line[key]:.2f}x (TRL's wall step / mgrpo's)")

    for i, policy in enumerate(policies):  # the first policy is the headline; the others carry their name
        ratio("tiny", policy, "mgrpo-hf", "trl-hf", "tiny_hf_speedup" + ("" if i == 0 else f"_{policy.lower()}"))
    mid = args.mid_policy
    ratio("mid", mid, "mgrpo-hf", "trl-hf", "mid_hf_speedup")
    if ("mid", mid, "trl-vllm") in results:
        ratio("mid", mid, "mgrpo-vllm", "trl-vllm", "mid_vllm_speedup")
    else:  # the labelled pair: mgrpo's vLLM against what TRL runs here
        ratio("mid", mid, "mgrpo-vllm", "trl-hf", "mid_vllm_vs_trl_default")
    best = [s for (size, _, who), s in results.items() if size == "mid" and who.startswith("mgrpo")]
    if best:
        line["mid_best_efficiency"] = max(s["efficiency"] for s in best)
    if ("mid", mid, "trl-hf") in results:
        line["trl_mid_efficiency"] = results[("mid", mid, "trl-hf")]["efficiency"]
    line["gemm_gflops"], line["bandwidth_gbs"] = machine.gemm / 1e9, machine.bw / 1e9
    print("result: " + " ".join(f"{k}={v:.2f}" for k, v in line.items()))


if __name__ == "__main__":
    main()
