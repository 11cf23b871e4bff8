"""Under torchrun: one weight push by collective broadcast from a megatron actor at the given layout into rollout
servers (`--transport collective`; `--engine sglang`: SGLang's protocol); rank 0 prints `receipt: {json}`. Used by tests/rollout/test_collective_sync.py.

    torchrun --nproc-per-node 4 tests/rollout/collective_push.py --tp 2 --pp 2 --model DIR --servers URL,URL \
        --version 7 --run-id tests
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class PeakRSS:
    """This process's resident memory above where it started, sampled every 5 ms until stop()."""

    def __init__(self):
        import threading

        import psutil

        self.proc, self.done = psutil.Process(), threading.Event()
        self.base = self.proc.memory_info().rss
        self.mb = 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.is_set():
            self.mb = max(self.mb, (self.proc.memory_info().rss - self.base) / 2**20)
            self.done.wait(0.005)

    def stop(self):
        self.done.set()
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--bucket-mb", type=int, default=1)
    ap.add_argument("--engine", choices=("remote", "sglang"), default="remote")
    ap.add_argument("--delta-steps", type=int, default=0, help="> 0: deltas (see delta_pushes)")
    ap.add_argument("--delta-dirs", default="", help="HF weight folders: each pushed as a delta, then whole")
    ap.add_argument("--params-dtype", default="float32")
    args = ap.parse_args()

    import torch.distributed as dist

    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.rollout.engines.remote import RemoteEngine
    from mgrpo.weights.transports.collective import CollectiveTransport

    cfg = load_config(
        argv=["--model.path", args.model, "--parallel.tp", str(args.tp), "--parallel.pp", str(args.pp)]
        + ["--model.params_dtype", args.params_dtype],
        check_files=False,
    )
    init_distributed()
    setup_model_parallel(cfg.parallel)
    actor = Actor(cfg, args.model, train=False)
    engine = None
    if args.engine == "sglang":
        from mgrpo.rollout.engines.sglang import SGLangEngine as RemoteEngine  # noqa: F811
        from mgrpo.weights.transports.collective_sglang import SGLangCollectiveTransport as CollectiveTransport
    if dist.get_rank() == 0:
        engine = RemoteEngine(
            args.servers.split(","),
            os.environ["MGRPO_SERVER_TOKEN"],
            load_tokenizer(args.model).eos_token_id,
            run_id=args.run_id,
        )
    if args.delta_steps:
        return delta_pushes(args, actor, engine, CollectiveTransport)
    if args.delta_dirs:
        return delta_and_whole(args, actor, engine, CollectiveTransport)
    transport = CollectiveTransport(engine, args.bucket_mb << 20)
    peak = PeakRSS()
    receipt = transport.send_model(actor.models(), args.version)
    peak.stop()
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, peak.mb)
    if dist.get_rank() == 0:
        receipt["sender_peak_mb"] = max(rss[r] for r in transport.senders)  # above where the push started
        print("receipt: " + json.dumps(receipt), flush=True)
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


def delta_pushes(args, actor, engine, transport_cls) -> None:
    """Deltas from every pipeline stage: version V whole, then `--delta-steps` pushes after sparse changes to the
    actor's weights (3% of each shard's elements move, as one RL step at a small LR), then the same weights once
    more as a whole version (the comparison: the servers' weights must not change); then, after one more change, a
    push against a base no server holds, refused and sent whole in the same push, and that version whole again. Rank 0 prints `delta: {json}` per push and `digest:
    {json}` (the servers' weight digests) after each."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mgrpo.netutil import http_json

    def digests():
        if engine is None:
            return None
        return [
            http_json(r.url, "GET", "/mgrpo/weights_digest", None, engine.headers, 30, engine.ssl, r.name)["workers"]
            for r in engine.replicas
        ]

    def push(version, label):
        receipt = transport.send_model(actor.models(), version)
        if dist.get_rank() == 0:
            print("delta: " + json.dumps(dict(label=label, version=version, **receipt["delta"])), flush=True)
            print("digest: " + json.dumps(dict(label=label, digests=digests())), flush=True)

    transport = transport_cls(engine, args.bucket_mb << 20, delta=True)
    g = torch.Generator().manual_seed(
        1000 * mpu.get_pipeline_model_parallel_rank() + mpu.get_tensor_model_parallel_rank()
    )
    version = args.version

    def change():
        with torch.no_grad():
            for p in (p for m in actor.models() for p in m.parameters()):
                moved = (torch.rand(p.shape, generator=g) < 0.03).to(p.dtype) * torch.randn(p.shape, generator=g)
                p.add_(1e-3 * moved)

    def whole(label):  # every rank: the same weights as a whole version
        nonlocal version
        transport.base_version, version = None, version + 1
        push(version, label)

    push(version, "first")
    for step in range(args.delta_steps):
        change()
        version += 1
        push(version, f"delta{step}")
    whole("whole")
    change()
    transport.base_version = 999  # a base no server holds (the owner believes they do): refused, then whole
    if engine is not None:
        for r in engine.replicas:
            r.version = 999
    version += 1
    push(version, "wrong_base")
    whole("whole_after_fallback")
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


def delta_and_whole(args, actor, engine, transport_cls) -> None:
    """benchmarks/weight_sync.py's collective delta rows: each folder of `--delta-dirs` (one training step's
    weights) loaded into the actor, pushed as a delta against the previous one, then whole (the same weights);
    rank 0 prints `row: {json}` per push: wall time, bytes, the delta's figures and the server's weight digest."""
    import time

    import torch.distributed as dist

    from mgrpo.netutil import http_json
    from mgrpo.weights.load import load_hf

    transport = transport_cls(engine, args.bucket_mb << 20, timeout_s=1200, delta=True)
    version = args.version
    for step, folder in enumerate(args.delta_dirs.split(",")):
        load_hf(actor.models(), folder)
        for kind in ("delta", "whole") if step else ("whole",):
            if kind == "whole":
                transport.base_version = None
            dist.barrier()
            t0 = time.perf_counter()
            receipt = transport.send_model(actor.models(), version)
            total = time.perf_counter() - t0
            if dist.get_rank() == 0:
                r = engine.replicas[0]
                digest = http_json(r.url, "GET", "/mgrpo/weights_digest", None, engine.headers, 60, engine.ssl, r.name)
                row = dict(kind=kind, step=step, total_s=total, digest=digest["workers"][0]["digest"])
                row.update({k: receipt[k] for k in ("bytes", "export_s", "transfer_s", "load_s", "senders")})
                row.update(dense_bytes=receipt["delta"]["dense_bytes"], delta_servers=len(receipt["delta"]["servers"]))
                print("row: " + json.dumps(row), flush=True)
            version += 1
    transport.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
