"""Weight sync by collective broadcast into SGLang servers (`rollout.engine: sglang`), SGLang's own protocol.

As for vLLM (`collective.py`), one sender per pipeline stage: each stage's (DP0, TP0, CP0) rank gathers its stage's
TP shards into full HF tensors and broadcasts them bucket by bucket; no rank holds more than its stage. SGLang's
side is its own code (`sglang/srt/model_executor/model_runner_components/weight_updater.py`, 0.5.23):

  open    each sender hosts a TCPStore on `rollout.remote.collective_bind` (port chosen by the OS) and the rank
          that owns the engine asks each server `POST /init_weights_update_group {master_address, master_port,
          rank_offset: 1, world_size: 1 + server TP, group_name, backend}`; the group name carries a one-time nonce
          (SGLang prefixes every store key with it), the sender joins as rank 0 (SGLang's `init_custom_process_group`
          seen from the other end: the same PrefixStore and `_new_process_group_helper`).
  update  owner: the guard's `/mgrpo/drain` (new generation calls wait, running ones finish on the old weights,
          so no response mixes versions), `/pause_generation {mode: retract}` (nothing is left running; the cache
          can be flushed),
          `/begin_weight_update`; then each sender, per bucket: `POST /update_weights_from_distributed {names,
          dtypes, shapes, group_name, load_format: "flattened_bucket", flush_cache: false}` while it broadcasts the
          bucket as one flat uint8 tensor (SGLang's `FlattenedTensorBucket` layout: back to back, no padding; a
          tensor whose offset would not be a multiple of its item size starts the next bucket), packed one tensor
          at a time as the export makes it (`weights/stream_pack.py`). One request per group in flight (SGLang
          serves them in order of arrival); the next bucket is gathered and packed meanwhile. Owner, when every
          stage is through: `/end_weight_update`, `/flush_cache`, `/update_weight_version {new_version,
          abort_all_requests: false}`, `/continue_generation`.
  check   mgrpo's guard in front of SGLang (`serving/sglang_guard.py`) checks each bucket's names and shapes
          against the model before SGLang sees them, and refuses the version (poisoning the server: SGLang
          loads as it receives) unless every tensor came exactly once.
"""

from __future__ import annotations

import datetime
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.weights.export import stage_senders, stage_tensors
from mgrpo.weights.stream_pack import StreamPacker, pack_stream
from mgrpo.weights.sync import PerStageSync, WeightSyncError


class SenderGroup:
    """Rank 0 of one SGLang weight-update group: hosts the store, then joins as SGLang's peers do."""

    def __init__(self, bind: str, group_name: str, backend: str, timeout_s: float):
        self.group_name, self.backend = group_name, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(bind, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.port, self.pg = self.store.port, None

    def join(self, size: int) -> None:
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        self.pg, _ = _new_process_group_helper(
            size,
            0,
            [],
            Backend(self.backend),
            PrefixStore(self.group_name, self.store),
            group_name=self.group_name,
            timeout=self.timeout,
        )
        _world.pg_group_ranks[self.pg] = {i: i for i in range(size)}

    def broadcast(self, flat: torch.Tensor):
        return dist.broadcast(flat, src=0, group=self.pg, async_op=True)

    def close(self) -> None:
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # noqa: BLE001  (a broken group: gone anyway)
                pass
        self.pg = self.store = None


DRAIN = "/mgrpo/drain"  # the guard's: new calls wait, running ones finish (else `retract` continues them, mixed)
PAUSE = ("/pause_generation", {"mode": "retract"})  # running requests go back to the queue; the cache may be flushed
BEGIN, END, FLUSH, RESUME = (
    ("/begin_weight_update", {}),
    ("/end_weight_update", {}),
    ("/flush_cache", {}),
    ("/continue_generation", {}),
)


def init_group_body(address: str, port: int, workers: int, group_name: str, backend: str) -> dict:
    """The sender is rank 0; the server's TP workers are ranks 1..workers (SGLang adds its TP rank to the offset)."""
    return {
        "master_address": address,
        "master_port": int(port),
        "rank_offset": 1,
        "world_size": 1 + int(workers),
        "group_name": group_name,
        "backend": backend,
    }


def bucket_body(meta: dict, group_name: str) -> dict:
    """One flattened bucket's request: its metadata; the bytes go by broadcast. No cache flush per bucket."""
    return dict(meta, group_name=group_name, load_format="flattened_bucket", flush_cache=False)


def version_body(version: int) -> dict:
    """After the pause nothing is in flight; SGLang's default would abort every running request."""
    return {"new_version": str(version), "abort_all_requests": False}


class SGLangCollectiveTransport(PerStageSync):
    def __init__(
        self,
        engine,
        bucket_bytes: int,
        bind: str = "127.0.0.1",
        timeout_s: float = 600.0,
        backend: str | None = None,
        ca_file: str = "",
    ):
        """engine: the SGLangEngine on the rank that owns it (global rank 0), None elsewhere. Every sender posts
        its own buckets' requests (with the owner's token and run headers, shared over the job's own group)."""
        from mgrpo.netutil import tls_context

        self.engine, self.bucket_bytes, self.bind, self.timeout_s = engine, bucket_bytes, bind, timeout_s
        self.ssl = tls_context(ca_file)
        self.opened: set = set()  # servers with open groups (on the owner)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.senders = stage_senders()
        self.stage = mpu.get_pipeline_model_parallel_rank()
        self.is_sender = dist.get_rank() in self.senders
        self.groups: dict = {}  # server name -> SenderGroup (on senders)
        self.abandoned: list = []  # groups of failed servers, left to their timeouts
        self.buffers = [None, None]

    # -- the owner's control calls -------------------------------------------------------------------------------
    def _each(self, replicas: list, path: str, body: dict, failed: dict) -> None:
        for r in replicas:
            if r.name in failed:
                continue
            try:
                self.engine.post(r, path, body, timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001
                failed[r.name] = f"{path}: {exc}"

    def send_model(self, model_chunks: list, version: int) -> dict | None:
        from mgrpo.parallel.device import share_json

        t0 = time.perf_counter()
        targets = self.engine.rejoin_candidates() if self.engine else []
        plan = {}
        for r in targets:
            try:
                workers = int(self.engine.get(r, "/mgrpo/version").get("workers", 1))
            except Exception as exc:  # noqa: BLE001
                self.engine.mark_down(r, str(exc))
                continue
            plan[r.name] = {
                "url": r.url,
                "workers": workers,
                "new": r.name not in self.opened,
                "group": f"mgrpo-{secrets.token_hex(12)}",
            }
        shared = share_json({"plan": plan, "headers": self.engine.update_headers() if self.engine else {}}, [0])[0]
        plan, headers = shared["plan"], shared["headers"]
        failed: dict = {}
        ports = share_json(self._host(plan) if self.is_sender else {}, self.senders)
        opening = self._open(plan, ports) if self.engine else None
        if self.is_sender:
            self._join(plan, failed)
        if opening is not None:
            for name, why in opening().items():
                failed.setdefault(name, why)
        live = [r for r in targets if r.name in plan and r.name not in failed]
        if self.engine:
            if getattr(self.engine, "in_flight", "finish") == "finish":  # calls in flight end on the old weights
                self._each(live, DRAIN, {"timeout_s": self.timeout_s}, failed)
            self._each(live, *PAUSE, failed)
            self._each(live, *BEGIN, failed)
        go = share_json(sorted(failed) if self.engine else [], [0])[0]
        # every rank: the TP gathers need them all; a sender's own join failures go into its report
        sent = self._broadcast(model_chunks, plan, headers, set(go), failed if self.is_sender else {})
        reports = share_json(sent if self.is_sender else {}, self.senders)
        if not self.engine:
            return None
        for rep in reports:
            for name, why in rep.get("failed", {}).items():
                failed.setdefault(name, why)
        done = [r for r in live if r.name not in failed]
        self._each(done, *END, failed)
        self._each(done, *FLUSH, failed)
        self._each(done, "/update_weight_version", version_body(version), failed)
        self._each(live, *RESUME, {})
        receipts = []
        for r in targets:
            if r.name not in plan:
                continue
            if r.name in failed:
                self.opened.discard(r.name)
                self.engine.mark_down(r, f"weight version {version} not applied (SGLang collective): {failed[r.name]}")
                continue
            self.opened.add(r.name)
            r.version = version
            receipts.append(r.name)
        if not receipts:
            raise WeightSyncError(f"weight version {version} reached no SGLang server: {self.engine.no_replica_left()}")
        self.engine.version = version
        return dict(
            version=version,
            servers=sorted(receipts),
            transport="collective-sglang",
            **self.sender_totals(reports),
            total_s=time.perf_counter() - t0,
        )

    def _open(self, plan: dict, ports: list):
        """Ask every server with new groups to join them (in threads: each call returns once the sender joined
        too). Returns a callable that waits for the answers: {server: why} for those that failed."""
        pool = ThreadPoolExecutor(max_workers=max(1, sum(1 for p in plan.values() if p["new"]) * len(ports)))
        calls = {}
        by_name = {r.name: r for r in self.engine.replicas}
        for name, p in plan.items():
            if not p["new"]:
                continue
            for stage, hosted in enumerate(ports):
                body = init_group_body(
                    self.bind, hosted[name], p["workers"], f"{p['group']}-stage{stage}", self.backend
                )
                calls[(name, stage)] = pool.submit(
                    self.engine.post, by_name[name], "/init_weights_update_group", body, self.timeout_s
                )

        def wait() -> dict:
            out = {}
            for (name, stage), fut in calls.items():
                try:
                    fut.result()
                except Exception as exc:  # noqa: BLE001
                    out.setdefault(name, f"could not open the weight-update group of stage {stage}: {exc}")
            pool.shutdown(wait=False)
            return out

        return wait

    # -- the senders -----------------------------------------------------------------------------------------------
    def _host(self, plan: dict) -> dict:
        """{server: port} of the store this sender hosts for each server that gets new groups."""
        for name in [n for n in self.groups if n not in plan or plan[n]["new"]]:
            self.groups.pop(name).close()
        ports = {}
        for name, p in plan.items():
            if p["new"]:
                self.groups[name] = SenderGroup(
                    self.bind, f"{p['group']}-stage{self.stage}", self.backend, self.timeout_s
                )
                ports[name] = self.groups[name].port
        return ports

    def _join(self, plan: dict, failed: dict) -> None:
        for name, p in plan.items():
            group = self.groups.get(name)
            if group is None:
                failed[name] = f"sender of stage {self.stage} holds no group for it"
            elif group.pg is None:
                try:
                    group.join(1 + p["workers"])
                except Exception as exc:  # noqa: BLE001
                    failed[name] = f"sender of stage {self.stage} could not join: {type(exc).__name__}: {exc}"
                    self.abandoned.append(self.groups.pop(name))  # never broadcast into a group not formed

    def _broadcast(self, model_chunks: list, plan: dict, headers: dict, skip: set, broken: dict) -> dict:
        """This stage's buckets into every live server: one request and one broadcast per bucket and server. Every
        rank calls it (the stage's TP ranks take part in the gathers); only senders get buckets."""
        from mgrpo.netutil import http_json

        failed = dict({name: "skipped" for name in skip}, **broken)
        stats = dict(bytes=0, buckets=0, export_s=0.0, transfer_s=0.0)
        pool = ThreadPoolExecutor(max_workers=max(1, len(plan)))
        inflight, t, on_wire = [], time.perf_counter(), None

        def settle(pending):
            for name, call, work in pending:
                try:
                    call.result()  # SGLang answers once it has the bucket, or refuses before it takes any
                    work.wait()
                except Exception as exc:  # noqa: BLE001  (a server gone or refusing mid-update)
                    failed.setdefault(name, f"stage {self.stage}: {type(exc).__name__}: {exc}")

        def emit(flat, meta):
            nonlocal inflight, t, on_wire
            stats["export_s"] += time.perf_counter() - t
            t = time.perf_counter()
            settle(inflight)  # one request per group in flight: SGLang takes them in order of arrival
            inflight, on_wire = [], flat  # (a tensor sent alone from its own memory lives until then)
            for name, group in self.groups.items():
                if name in failed or name not in plan:
                    continue
                body = bucket_body(meta, group.group_name)
                call = pool.submit(
                    http_json,
                    plan[name]["url"],
                    "POST",
                    "/update_weights_from_distributed",
                    body,
                    headers,
                    self.timeout_s,
                    self.ssl,
                    name,
                )
                inflight.append((name, call, group.broadcast(flat if group.backend == "gloo" else flat.cuda())))
            stats["transfer_s"] += time.perf_counter() - t
            stats["bytes"] += flat.numel()
            stats["buckets"] += 1
            t = time.perf_counter()

        packer = StreamPacker(self.buffers, self.bucket_bytes, "flattened")
        for flat, meta in pack_stream(stage_tensors(model_chunks, self.bucket_bytes), packer):
            emit(flat, meta)
        t = time.perf_counter()
        settle(inflight)
        stats["transfer_s"] += time.perf_counter() - t
        pool.shutdown(wait=False)
        for name in [n for n in failed if n not in skip]:
            group = self.groups.pop(name, None)
            if group is not None:  # its broadcast may still wait for a peer that never takes it: not joined here
                self.abandoned.append(group)
        return dict(stats, failed={n: why for n, why in failed.items() if n not in skip})

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.buffers = [None, None]
