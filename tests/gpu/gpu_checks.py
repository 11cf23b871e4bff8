"""The checks behind scripts/gpu_check.sh, in order, each with a time budget. One summary line is printed as each
check finishes (so a timeout still leaves results), then one `result:` line.

    python tests/gpu/gpu_checks.py            # on a CUDA machine: the real shapes (about 5 minutes on an H200)
    python tests/gpu/gpu_checks.py --tiny     # tiny shapes on whatever device there is (CI runs it on CPU)

Without CUDA and without --tiny it prints what it would run and why it skipped, and exits 0.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

QWEN25_05B = dict(family="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                  ffn_hidden_size=4864, tie_word_embeddings=True, rope_theta=1e6)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6)
TINY = dict(family="qwen2", vocab_size=300, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            ffn_hidden_size=256)
TINY_7B = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)

CHECKS = [  # name, budget (s), what it shows
    ("parity", 75, "megatron TP1 (local spec) logits vs HF, Qwen2.5-0.5B shape, 256 tokens: fp32 max|d| <= 1e-4; "
                   "bf16 max|d| <= 5e-2 and top-1 agreement >= 98%"),
    ("grpo_step", 75, "one GRPO step end to end (launch/train_grpo.py, nccl at world size 1, HF engine on the "
                      "GPU): weights synced, engine logprobs = trainer logprobs (fp32, mean |d| <= 1e-4)"),
    ("fused", 40, "fused vs naive logprob + entropy, vocab 152064, 8192 tokens, bf16: peak memory and time ratios"),
    ("sync_7b", 80, "export + in-process sync of a random Qwen2.5-7B-shape model in bf16: seconds and GB/s beside "
                    "a device-to-device copy of the same bytes"),
    ("cuda_ipc", 20, "a second process maps a CUDA-IPC weight buffer and reads the tensors back bitwise"),
]


def dev():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def setup_megatron():
    from mgrpo.config import ParallelConfig
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    init_distributed()  # nccl with CUDA (world size 1), gloo without
    setup_model_parallel(ParallelConfig())


def check_parity(args, root: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from mgrpo.config import ParallelConfig
    from mgrpo.models.builder import build_model
    from mgrpo.models.forward import full_logits
    from mgrpo.models.tiny import make_tiny_hf
    from mgrpo.resharding.load import load_hf

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    shape = TINY if args.tiny else QWEN25_05B
    model_dir = make_tiny_hf(os.path.join(root, "parity"), seed=0, **shape)
    setup_megatron()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (1, 64 if args.tiny else 256), generator=g).to(dev())
    out = {}
    for dtype in ("float32", "bfloat16"):
        chunks = build_model(model_dir, ParallelConfig(), dtype, 128, seed=0)
        load_hf(chunks, model_dir)
        mine = full_logits(chunks[0], ids)[..., : shape["vocab_size"]].float()
        del chunks
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(dev()).eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        del hf
        diff = float((mine - ref).abs().max())
        out[f"{dtype}_maxdiff"] = diff
        if dtype == "bfloat16":
            out["bf16_top1"] = float((mine.argmax(-1) == ref.argmax(-1)).float().mean())
    ok = out["float32_maxdiff"] <= 1e-4 and out["bfloat16_maxdiff"] <= 5e-2 and out["bf16_top1"] >= 0.98
    return dict(ok=ok, parity_fp32_maxdiff=f"{out['float32_maxdiff']:.2e}",
                parity_bf16_maxdiff=f"{out['bfloat16_maxdiff']:.2e}", parity_bf16_top1=f"{out['bf16_top1']:.4f}")


def check_grpo_step(args, root: str) -> dict:
    import json

    out_dir = os.path.join(root, "grpo")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train_grpo.py"), "--config",
           os.path.join(ROOT, "examples", "tiny_cpu.yaml"), "--train.steps", "2", "--rollout.engine", "hf",
           "--model.path", os.path.join(out_dir, "model"), "--logging.output_dir", out_dir,
           "--logging.tensorboard", "false", "--logging.report", "false", "--model.params_dtype", "float32"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"train_grpo.py exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    diffs = [r[k] for r in rows for k in r if k.endswith("rollout_logp_abs_diff")]
    if not diffs:
        raise RuntimeError("metrics.jsonl has no rollout_logp_abs_diff (engine vs trainer logprobs)")
    worst = max(diffs)  # step 2 samples from weights synced after step 1's update
    return dict(ok=worst <= 1e-4 and len(rows) == 2, grpo_steps=len(rows), grpo_logp_abs_diff=f"{worst:.2e}")


def check_fused(args, root: str) -> dict:
    import torch

    from mgrpo.loss.logprobs import vocab_parallel_logprobs

    vocab, tokens = (3000, 512) if args.tiny else (152064, 8192)
    dtype = torch.bfloat16 if dev().type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, tokens, vocab, generator=g) * 2).to(dev(), dtype)
    targets = torch.randint(0, vocab, (1, tokens), generator=g).to(dev())

    def naive(x, t):
        logp = torch.log_softmax(x.float(), -1)
        return logp.gather(-1, t[..., None])[..., 0], -(logp.exp() * logp).sum(-1)

    def fused(x, t):
        return vocab_parallel_logprobs(x, t, None, compute_entropy=True)

    stats = {}
    for name, fn in (("naive", naive), ("fused", fused), ("naive", naive), ("fused", fused)):  # 2nd rep timed
        x = logits.detach().requires_grad_(True)
        sync()
        if dev().type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev().type == "cuda" else 0
        t0 = time.perf_counter()
        lp, ent = fn(x, targets)
        (lp.sum() + 0.1 * ent.sum()).backward()
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) if dev().type == "cuda" else 0
        stats[name] = dict(s=time.perf_counter() - t0, peak=peak, lp=lp.detach().float(), grad=x.grad.float())
    d = float((stats["fused"]["lp"] - stats["naive"]["lp"]).abs().max())
    mem = stats["fused"]["peak"] / max(stats["naive"]["peak"], 1) if dev().type == "cuda" else float("nan")
    tr = stats["fused"]["s"] / stats["naive"]["s"]
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    return dict(ok=d <= tol and (mem != mem or mem < 1.0), fused_mem_ratio=f"{mem:.3f}", fused_time_ratio=f"{tr:.2f}",
                fused_logp_maxdiff=f"{d:.1e}")


def check_sync_7b(args, root: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mgrpo.config import ParallelConfig
    from mgrpo.models.builder import build_model
    from mgrpo.resharding.export import export_hf
    from mgrpo.rollout.engines.hf import HFEngine

    shape = TINY_7B if args.tiny else QWEN25_7B
    model_dir = os.path.join(root, "q7b")
    os.makedirs(model_dir, exist_ok=True)
    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, rms_norm_eps=1e-6, **shape)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(model_dir)  # config only: both sides start from random weights
    setup_megatron()
    dtype = "bfloat16"
    chunks = build_model(model_dir, ParallelConfig(), dtype, 128, seed=0)
    with torch.device(dev()):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    engine = HFEngine(model_dir, 0, 0, device=dev(), model=hf)
    nbytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    sync()
    t0 = time.perf_counter()
    receipt = engine.weight_transport(1 << 30).send(export_hf(chunks, dst=0, bucket_bytes=1 << 30), 1)
    sync()
    secs = time.perf_counter() - t0
    name = "model.layers.0.mlp.down_proj.weight"  # spot check: the engine now holds the trainer's tensor
    mine = dict(export_hf(chunks, dst=0))[name]
    same = bool(torch.equal(mine.to(dev()), dict(hf.named_parameters())[name]))
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev())
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t1 = time.perf_counter()
    dst.copy_(src)
    sync()
    copy_s = time.perf_counter() - t1
    return dict(ok=same and receipt["tensors"] == len(dict(hf.named_parameters())), sync_7b_s=f"{secs:.2f}",
                sync_7b_GBps=f"{nbytes / secs / 1e9:.1f}", d2d_copy_s=f"{copy_s:.3f}",
                d2d_GBps=f"{nbytes / copy_s / 1e9:.0f}", sync_7b_GB=f"{nbytes / 1e9:.1f}")


CHILD = """
import json, sys, hashlib
sys.path.insert(0, {root!r})
import torch
from mgrpo.rollout.transports.buffers import open_buffer
buf = open_buffer(json.loads(sys.stdin.read()))
print(hashlib.sha256(buf.view.cpu().numpy().tobytes()).hexdigest())
"""


def check_cuda_ipc(args, root: str) -> dict:
    import hashlib
    import json

    import torch

    from mgrpo.rollout.transports.buffers import CudaIpcBuffer

    if not torch.cuda.is_available():
        return dict(ok=True, cuda_ipc="skipped(no CUDA)")
    buf = CudaIpcBuffer("check", 64 << 20)
    g = torch.Generator(device="cuda").manual_seed(0)
    buf.view.copy_(torch.randint(0, 256, (buf.nbytes,), device="cuda", generator=g, dtype=torch.uint8))
    sync()
    want = hashlib.sha256(buf.view.cpu().numpy().tobytes()).hexdigest()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT)], input=json.dumps(buf.describe()),
                          capture_output=True, text=True, timeout=120)
    got = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
    return dict(ok=got == want, cuda_ipc="bitwise" if got == want else f"differs({got[:40]})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on any device (CI runs the code on CPU)")
    ap.add_argument("--only", default="", help="comma-separated check names")
    args = ap.parse_args()
    import torch

    names = [n for n in args.only.split(",") if n] or [n for n, _, _ in CHECKS]
    unknown = set(names) - {n for n, _, _ in CHECKS}
    if unknown:
        print(f"error: --only: unknown check(s) {sorted(unknown)}; known: {[n for n, _, _ in CHECKS]}")
        return 2
    cuda = torch.cuda.is_available()
    print(f"gpu_check: torch {torch.__version__}, CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'}"
          f"{', tiny shapes' if args.tiny else ''}", flush=True)
    if not cuda and not args.tiny:
        for name, budget, what in CHECKS:
            print(f"  skip {name} (budget {budget} s): {what}")
        print("skipped: no CUDA device here; run `bash scripts/gpu_check.sh` on a GPU machine (README, GPU section)")
        print("result: gpu_check=skipped checks=0/" + str(len(CHECKS)))
        return 0
    fns = {"parity": check_parity, "grpo_step": check_grpo_step, "fused": check_fused, "sync_7b": check_sync_7b,
           "cuda_ipc": check_cuda_ipc}
    result, passed = {}, 0
    with tempfile.TemporaryDirectory(prefix="mgrpo-gpu-check-") as root:
        for name, budget, _ in CHECKS:
            if name not in names:
                continue
            t0 = time.perf_counter()
            try:
                out = fns[name](args, root)
                ok = out.pop("ok")
            except Exception as exc:  # noqa: BLE001  (one check failing must not hide the others)
                traceback.print_exc(limit=3)
                out, ok = {f"{name}_error": f"{type(exc).__name__}:{str(exc)[:120]}".replace(" ", "_")}, False
            secs = time.perf_counter() - t0
            passed += ok
            result.update(out)
            late = f" OVER BUDGET ({budget} s)" if secs > budget else ""
            print(f"check {name}: {'PASS' if ok else 'FAIL'} {' '.join(f'{k}={v}' for k, v in out.items())} "
                  f"({secs:.1f} s{late})", flush=True)
    print("result: " + " ".join(f"{k}={v}" for k, v in result.items()) + f" checks={passed}/{len(names)}")
    return 0 if passed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
