"""Weight sync to a remote rollout server, side by side in one run: over HTTP one request per tensor vs 64 MB
buckets (both with the sha256 trailer) and 64 MB buckets with the fast xxh3_128 trailer (the default); by
collective broadcast (gloo, 64 MB buckets, rollout.remote.transport: collective) at TP1 and, through torchrun, at
TP2xPP2 (two senders, one per stage); and the limit: the same bytes as plain gloo broadcasts of one preallocated
buffer between the same two processes (no export, no manifest, no load). The same ~100M-parameter Qwen2-style model
(fp32) goes from a megatron actor into the same guarded vLLM server (launch/rollout_server.py --transport
collective, on loopback). Time is split into export (megatron -> HF tensors), transfer, load (the server's vLLM
reload) and cache reset; peak RSS above the starting point is sampled on both sides during each push.

    python benchmarks/weight_sync.py [--model 100m|tiny] [--reps 2] [--delta-only | --skip-delta]

Then the delta rows (benchmarks/weight_sync_delta.py): an ~85M bf16 model trained real steps at LR 1e-6 and 1e-5,
each step pushed whole and as a delta to a bf16 server, on loopback and an emulated 1 Gb/s link; then the LR 1e-6
steps again by collective broadcast from a bf16 megatron actor at TP1 and TP2xPP2 (each stage sender sending its own
deltas), each step as a delta then whole.

Ends with one line: result: http_s=... collective_s=... limit_s=... collective_vs_http=... collective_vs_limit=...
peak_rss_mb=... delta_bytes_frac=... delta_http_speedup=... (the HTTP figure is the default 64 MB xxh3_128 path;
ratios are speedups at TP1; the delta figures at LR 1e-6, on loopback unless named) delta_collective_tp1pp1_speedup=...
delta_collective_tp2pp2_speedup=... (and their bytes fractions and bitwise pairs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
    "tiny": dict(
        family="qwen2", vocab_size=300, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=256
    ),
    "100m": dict(
        family="qwen2",
        vocab_size=32000,
        hidden_size=640,
        num_layers=12,
        num_heads=10,
        num_kv_heads=2,
        ffn_hidden_size=1792,
    ),
}
TOKEN = "benchmark-" + os.urandom(8).hex()


class PeakRSS:
    """Peak resident memory of some processes above where it started, sampled every 5 ms."""

    def __init__(self, procs):
        self.procs, self.stop, self.peak = procs, threading.Event(), 0

    def rss(self) -> int:
        total = 0
        for p in self.procs():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def __enter__(self):
        self.base = self.rss()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss() - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def start_server(model: str, port: int, log: str, extra: tuple = ()) -> subprocess.Popen:
    env = dict(os.environ, MGRPO_SERVER_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "rollout_server.py"),
            "--model",
            model,
            "--port",
            str(port),
            "--transport",
            "collective",
            *extra,
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while f"ready: http://127.0.0.1:{port}" not in open(log).read():
        if proc.poll() is not None or time.time() > deadline:
            sys.exit("the rollout server did not start:\n" + open(log).read()[-3000:])
        time.sleep(0.5)
    return proc


def push(engine, actor, bucket_bytes: int, version: int, server_pid: int, algo: str) -> dict:
    from mgrpo.weights.export import export_hf

    server = psutil.Process(server_pid)
    transport = engine.weight_transport(bucket_bytes, algo=algo)
    t0 = time.perf_counter()
    with (
        PeakRSS(lambda: [psutil.Process()]) as mine,
        PeakRSS(lambda: [server] + server.children(recursive=True)) as theirs,
    ):
        receipt = transport.send(export_hf(actor.models(), dst=0, bucket_bytes=64 << 20), version)
    transport.close()
    return dict(
        receipt, total_s=time.perf_counter() - t0, trainer_peak_mb=mine.peak / 2**20, server_peak_mb=theirs.peak / 2**20
    )


def push_collective(transport, actor, version: int, server_pid: int) -> dict:
    server = psutil.Process(server_pid)
    t0 = time.perf_counter()
    with (
        PeakRSS(lambda: [psutil.Process()]) as mine,
        PeakRSS(lambda: [server] + server.children(recursive=True)) as theirs,
    ):
        receipt = transport.send_model(actor.models(), version)
    return dict(
        receipt, total_s=time.perf_counter() - t0, trainer_peak_mb=mine.peak / 2**20, server_peak_mb=theirs.peak / 2**20
    )


def push_tp2_pp2(model: str, port: int, version: int) -> dict:
    """TP2xPP2 (4 ranks, two senders) through torchrun; the same server (the script: tests/rollout/)."""
    from mgrpo.parallel.distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(free_port()),
            os.path.join(ROOT, "tests", "rollout", "collective_push.py"),
            "--tp",
            "2",
            "--pp",
            "2",
            "--model",
            model,
            "--version",
            str(version),
            "--bucket-mb",
            "64",
            "--servers",
            f"http://127.0.0.1:{port}",
            "--run-id",
            "benchmark",
        ],
        capture_output=True,
        text=True,
        env=dict(env, MGRPO_SERVER_TOKEN=TOKEN),
        timeout=1200,
    )
    if r.returncode:
        sys.exit("the TP2xPP2 push failed:\n" + r.stderr[-3000:])

    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("receipt: "))[9:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="100m", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--delta-only", action="store_true", help="only the delta rows (weight_sync_delta.py)")
    ap.add_argument("--skip-delta", action="store_true")
    args = ap.parse_args()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    delta = {} if args.skip_delta else delta_rows()
    if args.delta_only:
        print("result: " + delta_result(delta))
        return
    from mgrpo.actor import Actor
    from mgrpo.config import ParallelConfig, load_config
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.models.tiny import make_tiny_hf
    from mgrpo.parallel.distributed import free_port, init_distributed
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.rollout.engines.remote import RemoteEngine
    from mgrpo.weights.transports.collective import CollectiveTransport

    with tempfile.TemporaryDirectory() as root:
        model = make_tiny_hf(os.path.join(root, "model"), seed=0, **MODELS[args.model])
        port = free_port()
        server = start_server(model, port, os.path.join(root, "server.log"))
        try:
            init_distributed()
            setup_model_parallel(ParallelConfig())
            cfg = load_config(argv=["--model.path", model], check_files=False)
            actor = Actor(cfg, model, train=False)
            largest = max(p.numel() * p.element_size() for c in actor.models() for p in c.parameters())
            engine = RemoteEngine(
                [f"http://127.0.0.1:{port}"],
                TOKEN,
                load_tokenizer(model).eos_token_id,
                update_timeout_s=1200,
                run_id="benchmark",
            )
            transport = CollectiveTransport(engine, 64 << 20, timeout_s=1200)
            rows, version = {}, 0
            runs = (
                ("per tensor", 1, "sha256"),
                ("64 MB buckets", 64 << 20, "sha256"),
                ("64 MB, xxh3", 64 << 20, "xxh3_128"),
                ("collective", 64 << 20, None),
                ("limit", 64 << 20, None),
            )
            for label, bucket, algo in runs * args.reps:
                version += 1
                if label == "collective":
                    rows.setdefault(label, []).append(push_collective(transport, actor, version, server.pid))
                elif label == "limit":
                    nbytes = rows["collective"][-1]["bytes"]
                    p = transport.probe(nbytes, bucket)
                    rows.setdefault(label, []).append(
                        dict(
                            total_s=max(p["send_s"], p["receive_s"]),
                            buckets=-(-nbytes // bucket),
                            export_s=0.0,
                            transfer_s=p["send_s"],
                            load_s=0.0,
                            reset_s=0.0,
                            trainer_peak_mb=bucket / 2**20,
                            server_peak_mb=bucket / 2**20,
                            bytes=nbytes,
                        )
                    )
                else:
                    rows.setdefault(label, []).append(push(engine, actor, bucket, version, server.pid, algo))
            transport.close()
            tp2pp2 = [push_tp2_pp2(model, port, version + 1 + i) for i in range(args.reps)]
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    best = {k: min(v, key=lambda r: r["total_s"]) for k, v in rows.items()}
    fastest = min(tp2pp2, key=lambda r: r["total_s"])
    best["collective TP2xPP2"] = dict(fastest, trainer_peak_mb=fastest["sender_peak_mb"], server_peak_mb=float("nan"))
    print(
        f"model {args.model}: {best['64 MB buckets']['bytes'] / 2**20:.0f} MiB of weights, largest tensor "
        f"{largest / 2**20:.0f} MiB; best of {args.reps}"
    )
    print(
        f"{'':18} {'requests':>8} {'total s':>8} {'export s':>9} {'transfer s':>11} {'load s':>7} {'reset s':>8} "
        f"{'trainer +MB':>12} {'server +MB':>11}"
    )
    for label, r in best.items():
        print(
            f"{label:18} {r['buckets']:8d} {r['total_s']:8.2f} {r['export_s']:9.2f} {r['transfer_s']:11.2f} "
            f"{r['load_s']:7.2f} {r['reset_s']:8.3f} {r['trainer_peak_mb']:12.0f} {r['server_peak_mb']:11.0f}"
        )
    per, buck = best["per tensor"]["total_s"], best["64 MB buckets"]["total_s"]
    http, coll, limit = best["64 MB, xxh3"]["total_s"], best["collective"]["total_s"], best["limit"]["total_s"]
    bound = 2 * 64 + largest / 2**20 + 64
    peak = best["collective"]["trainer_peak_mb"]
    print(f"HTTP per tensor vs 64 MB buckets: {per / buck:.2f}x; xxh3_128 instead of sha256: {buck / http:.2f}x")
    print(
        f"collective vs HTTP (xxh3, the default): {http / coll:.2f}x; limit / collective: {limit / coll:.2f} "
        f"(the wire alone: {best['limit']['bytes'] / 2**20 / limit:.0f} MiB/s); TP2xPP2 (two senders): "
        f"{best['collective TP2xPP2']['total_s']:.2f} s"
    )
    split = next(iter(best["collective"]["server"].values()))
    print(
        f"collective, server side: receive {split['receive_s']:.2f} s (while the sender exports and broadcasts), "
        f"check + reload {split['reload_s']:.2f} s; the HTTP path's load (check + reload from /dev/shm files): "
        f"{best['64 MB, xxh3']['load_s']:.2f} s"
    )
    print(
        f"trainer-side peak, collective: {peak:.0f} MB (bound: two buckets 128 + largest tensor "
        f"{largest / 2**20:.0f} + 64 = {bound:.0f} MB); largest TP2xPP2 sender: "
        f"{best['collective TP2xPP2']['trainer_peak_mb']:.0f} MB"
    )
    print(
        f"result: http_s={http:.3f} collective_s={coll:.3f} limit_s={limit:.3f} collective_vs_http={http / coll:.2f} "
        f"collective_vs_limit={limit / coll:.2f} tp2pp2_collective_s={best['collective TP2xPP2']['total_s']:.3f} "
        f"peak_rss_mb={peak:.0f} tp2pp2_sender_peak_mb={best['collective TP2xPP2']['trainer_peak_mb']:.0f} "
        f"server_peak_rss_mb={best['collective']['server_peak_mb']:.0f}" + (" " + delta_result(delta) if delta else "")
    )


def delta_rows() -> dict:
    """Full vs delta pushes of the ~85M model in bf16, trained real steps (benchmarks/weight_sync_delta.py)."""
    from benchmarks.vs_trl import SIZES
    from benchmarks.weight_sync_delta import run
    from mgrpo.models.tiny import make_tiny_hf
    from mgrpo.parallel.distributed import free_port

    with tempfile.TemporaryDirectory() as root:
        model = make_tiny_hf(os.path.join(root, "model"), seed=0, **SIZES["mid"]["model"])
        port = free_port()
        server = start_server(model, port, os.path.join(root, "server.log"), ("--dtype", "bfloat16"))
        try:
            out, saved, version = run(model, port, TOKEN, save_dir=root)
            for tp, pp in ((1, 1), (2, 2)):  # the LR 1e-6 steps again, over the collective transport
                rows = collective_delta(model, port, tp, pp, saved[1e-6], version + 1)
                version += len(rows) + 1
                out.update(collective_summary(rows, f"tp{tp}pp{pp}"))
            return out
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def collective_delta(model: str, port: int, tp: int, pp: int, folders: list, version: int) -> list:
    """Each training step's weights pushed by collective broadcast as a delta then whole, at TP x PP (torchrun;
    one sender per stage), bf16, 64 MB buckets; rows as tests/rollout/collective_push.py prints them."""
    from mgrpo.parallel.distributed import free_port

    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp)]
    cmd += ["--master-port", str(free_port()), os.path.join(ROOT, "tests", "rollout", "collective_push.py")]
    cmd += ["--tp", str(tp), "--pp", str(pp), "--model", model, "--version", str(version), "--bucket-mb", "64"]
    cmd += ["--servers", f"http://127.0.0.1:{port}", "--run-id", "benchmark-delta", "--params-dtype", "bfloat16"]
    cmd += ["--delta-dirs", ",".join(folders)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, MGRPO_SERVER_TOKEN=TOKEN), timeout=1800)
    if r.returncode:
        sys.exit(f"the TP{tp}xPP{pp} collective delta pushes failed:\n" + r.stderr[-3000:])
    return [json.loads(x[5:]) for x in r.stdout.splitlines() if x.startswith("row: ")]


def collective_summary(rows: list, layout: str) -> dict:
    """Delta vs whole push of the same weights over the collective transport: medians, bytes, bitwise pairs."""
    import statistics

    print(f"\ncollective {layout} (bf16, LR 1e-6, loopback gloo): step, push, wall s, MB, of dense, digest")
    for r in rows:
        print(
            f"  {r['step']:2d} {r['kind']:6} {r['total_s']:7.2f} {r['bytes'] / 1e6:8.1f} "
            f"{r['bytes'] / r['dense_bytes']:7.3f} {r['digest'][:12]}"
        )
    deltas = [r for r in rows if r["kind"] == "delta"]
    wholes = [r for r in rows if r["kind"] == "whole" and r["step"] > 0]
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["kind"] == "delta" and b["kind"] == "whole"]
    out = {
        f"delta_collective_{layout}_speedup": statistics.median(r["total_s"] for r in wholes)
        / statistics.median(r["total_s"] for r in deltas),
        f"delta_collective_{layout}_bytes_frac": statistics.median(r["bytes"] / r["dense_bytes"] for r in deltas),
        f"delta_collective_{layout}_bitwise": sum(a["digest"] == b["digest"] for a, b in pairs) / max(len(pairs), 1),
    }
    for k, v in out.items():
        print(f"{k}: {v:.3f}")
    return out


def delta_result(d: dict) -> str:
    return (
        f"delta_bytes_frac={d['delta_bytes_frac_1e-06']:.4f} idx_val_bytes_frac={d['idx_val_bytes_frac_1e-06']:.4f} "
        f"delta_bytes_frac_lr1e-5={d['delta_bytes_frac_1e-05']:.4f} delta_http_speedup={d['delta_http_speedup_1e-06']:.2f} "
        f"delta_http_1gbps_speedup={d['delta_http_1gbps_speedup_1e-06']:.2f} "
        f"delta_bitwise_bf16={d['delta_bitwise_pairs']:.2f} "
        + " ".join(f"{k}={v:.3f}" for k, v in d.items() if k.startswith("delta_collective_"))
    )


if __name__ == "__main__":
    main()
