"""Weight sync by collective broadcast into remote rollout servers (`rollout.remote.transport: collective`).

One sender per pipeline stage: each stage's (DP0, TP0, CP0) rank gathers its own stage's TP shards into full HF
tensors (`weights/export.py::stage_tensors`) and broadcasts them, bucket by bucket, into one process group per
server (`collective_group.py`); no rank ever holds more than its stage, and stages send at the same time. Each
bucket is one flat buffer with its manifest, packed one tensor at a time as the export makes it
(`weights/stream_pack.py`); the next bucket is gathered and packed while the current one is on the wire (two
buffers, the gather in progress and one parameter's full tensors alive at most). The server checks every bucket
against the model and the whole set for completeness before it loads anything (`serving/collective_receiver.py`).

Control stays on HTTP, driven by the rank that owns the engine (global rank 0): it opens groups on the servers
that have none (`POST /mgrpo/collective/open`: address, port and a one-time nonce come back, nothing listened
before), shares them with the senders, and asks each server to take the version (`.../{version}/update`) while
the senders broadcast. A server that breaks mid-broadcast is excluded (its group closed); at a later update, if
it answers again, it gets new groups and the whole model. Every rank constructs this and calls `send_model`.

With `delta` (`rollout.remote.delta`), each stage sender keeps the last version it sent of its own stage's tensors
(`mgrpo.weights.delta.DeltaSender`: host memory, the stage's share of the model in the wire dtype) and, when every
server holds that version, sends each tensor as what changed: PP stages send their own deltas at the same time. A
server without the base (restarted, excluded) makes that push whole for every server; one that refuses a delta
(another base, a digest mismatch) gets the whole version from the senders' bases in a second round of the same
push (no export again).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from mgrpo.weights.delta import NEED_FULL, DeltaSender
from mgrpo.weights.export import stage_senders, stage_tensors
from mgrpo.weights.stream_pack import StreamPacker, pack_stream
from mgrpo.weights.sync import PerStageSync, WeightSyncError, held_in_flight
from mgrpo.weights.transports.collective_group import (
    join_group,
    send_bucket,
    send_end,
    version_mismatch,
    wire_versions,
)


class CollectiveTransport(PerStageSync):
    def __init__(
        self,
        engine,
        bucket_bytes: int,
        bind: str = "127.0.0.1",
        timeout_s: float = 600.0,
        delta: bool = False,
        full_every: int = 0,
    ):
        """engine: the RemoteEngine on the rank that owns it (global rank 0), None elsewhere. The backend (gloo,
        nccl) is the server's; `bind`: the address the senders' data connections use. `delta`: send what changed
        (`full_every` > 0: a whole version every that many versions)."""
        self.engine, self.bucket_bytes, self.bind = engine, bucket_bytes, bind
        self.timeout_s = timeout_s
        self.senders = stage_senders()
        self.me, self.stage = dist.get_rank(), mpu.get_pipeline_model_parallel_rank()
        self.is_sender = self.me in self.senders
        self.groups: dict = {}  # server name -> Group (on senders)
        self.opened: set = set()  # servers with open groups (on the owner)
        self.buffers = [None, None]  # the double buffer of flat buckets (on senders)
        self.keep_base, self.full_every = delta, full_every
        self.delta = DeltaSender() if delta and self.is_sender else None  # this stage's last version sent
        self.base_version: int | None = None  # the version every sender's base holds (the same on all ranks)
        self.codecs: dict = {}  # codec entries of coded tensors not yet in a bucket's manifest

    # -- control (the owner) -------------------------------------------------------------------------------------
    def _open_new(self, targets: list) -> dict:
        """{server: "keep" | {host, port, nonce, workers}} for every target; opens groups where none are."""
        plan = {}
        for r in targets:
            if r.name in self.opened:
                plan[r.name] = "keep"
                continue
            try:
                mine = {"torch": wire_versions("gloo")["torch"], "nccl": _nccl_version()}
                body = {"senders": len(self.senders), "versions": mine}
                info = self.engine.post(r, "/mgrpo/collective/open", body, timeout=30)
                mismatch = version_mismatch(mine, info.get("versions"), info.get("backend", "gloo"))
                if mismatch:  # a server that did not check (or checked otherwise): never join a group that may hang
                    self.engine.mark_down(r, mismatch)
                    continue
                plan[r.name] = {
                    k: info[k] for k in ("host", "port", "nonce", "workers", "backend", "timeout_s", "op_timeout_s")
                }
            except Exception as exc:  # noqa: BLE001
                hint = " (start it with --transport collective)" if " -> 404 " in str(exc) else ""
                self.engine.mark_down(r, f"cannot open collective groups{hint}: {exc}")
        return plan

    def send_model(self, model_chunks: list, version: int) -> dict | None:
        """Push one weight version to every server that is up (or answers again). Returns the receipt on the owner
        (None elsewhere); raises WeightSyncError on the owner when no server took it."""
        from mgrpo.parallel.device import share_json

        t0 = time.perf_counter()
        targets = self.engine.rejoin_candidates() if self.engine else []
        base = self.base_version
        if base is not None and self.full_every and version % self.full_every == 0:
            base = None  # rollout.remote.full_every: a whole version now and then
        if self.engine and not all(r.version == base for r in targets):
            base = None  # a server without the base: this push is whole for all (one stream per stage)
        plan, base = share_json([self._open_new(targets), base] if self.engine else [{}, None], [0])[0]
        if self.delta is not None:
            self.delta.reset_stats()
        source = stage_tensors(model_chunks, self.bucket_bytes)
        try:
            if self.delta is not None:  # every push refreshes the base; only a delta push codes against it
                source = self._coded(source, delta=base is not None)
            reports, receipts, need_full = self._round(plan, targets, version, source, base, prune=True)
            again = share_json(sorted(need_full) if self.engine else [], [0])[0]
            took_delta = sorted(receipts) if base is not None else []  # before the second round adds its own
            if again:  # refused deltas: the whole version from the senders' bases, in the same push
                retry = [r for r in targets if r.name in again]
                plan = share_json(self._open_new(retry) if self.engine else {}, [0])[0]
                base_items = iter(self.delta.items()) if self.delta is not None else iter(())
                more, fixed, _ = self._round(plan, retry, version, base_items, None, prune=False)
                receipts.update(fixed)
                reports = [dict(a, bytes=a.get("bytes", 0) + b.get("bytes", 0)) for a, b in zip(reports, more)]
        except BaseException:
            self._forget_base()  # a base may hold part of this version: the next push is whole
            raise
        self.base_version = version if self.keep_base else None  # every sender's base now holds `version`
        if self.delta is not None:
            self.delta.commit(version)
        if not self.engine:
            return None
        if not receipts:
            raise WeightSyncError(
                f"weight version {version} reached no rollout server: {self.engine.no_replica_left()}"
            )
        self.engine.version = version
        first = next(iter(receipts.values()))
        out = dict(
            version=version,
            servers=sorted(receipts),
            transport="collective",
            **self.sender_totals(reports),
            receive_s=max(x.get("receive_s", 0.0) for x in receipts.values()),
            server={name: {k: v for k, v in x.items() if k.endswith("_s")} for name, x in receipts.items()},
            load_s=max(x.get("load_s", 0.0) for x in receipts.values()),
            reset_s=max(x.get("reset_s", 0.0) for x in receipts.values()),
            total_s=time.perf_counter() - t0,
            tensors=first.get("tensors"),
            **held_in_flight(receipts),
        )
        if self.keep_base:
            stages = [rep.get("delta", {}) for rep in reports]
            out["delta"] = dict(
                {k: sum(st.get(k, 0) for st in stages) for k in ("dense_bytes", "wire_bytes", "changed", "elements")},
                base=base,
                servers=took_delta,
                full_fallback=list(again),
                base_host_bytes=max(st.get("base_host_bytes", 0) for st in stages),
                stages=stages,  # each stage sender's own: what it sent against its own base
            )
        return out

    def _round(self, plan: dict, targets: list, version: int, source, base, prune: bool) -> tuple:
        """One broadcast of `source` into the servers of `plan` (`base`: as deltas against it): (every sender's
        report, {server: receipt} on the owner, servers that refused a delta and need the whole version)."""
        from mgrpo.parallel.device import share_json

        failed = self._join(plan, prune) if self.is_sender else {}
        requests, pool = {}, None
        if self.engine:
            live = [r for r in targets if r.name in plan and r.name not in failed]
            pool = ThreadPoolExecutor(max_workers=max(len(live), 1))
            body = {
                "delta_base": base,
                "keep_base": self.keep_base,
                "in_flight": getattr(self.engine, "in_flight", "finish"),
            }
            requests = {
                r.name: pool.submit(
                    self.engine.post, r, f"/mgrpo/collective/{version}/update", body, self.timeout_s + 30
                )
                for r in live
            }
        sent = self._broadcast(source, version, failed, list(plan), base)
        # every sender's failures reach the owner (one small JSON broadcast per sender)
        reports = share_json({"failed": failed, **sent} if self.is_sender else {}, self.senders)
        if not self.engine:
            return reports, {}, []
        broken = {name: why for rep in reports for name, why in rep.get("failed", {}).items()}
        receipts, need_full = {}, []
        for r in targets:
            if r.name not in plan:
                continue
            why, receipt = broken.get(r.name), None
            try:  # a broken broadcast is this server's answer: its HTTP reply is not waited for (a hung host)
                receipt = requests[r.name].result() if r.name in requests and not why else None
            except Exception as exc:  # noqa: BLE001
                why = why or str(exc)
            if receipt is None and base is not None and NEED_FULL in str(why):
                self.opened.discard(r.name)  # the server tore its groups down; the second round opens new ones
                need_full.append(r.name)
                continue
            if why or receipt is None:
                self.opened.discard(r.name)
                self.engine.mark_down(r, f"weight version {version} not applied (collective): {why}")
                continue
            self.opened.add(r.name)
            receipts[r.name], r.version = receipt, version
        pool.shutdown(wait=False)
        return reports, receipts, need_full

    def _coded(self, source, delta: bool, group_bytes: int = 32 << 20):
        """(name, wire tensor) of this stage's tensors, each replacing its base; with `delta`, the tensors that
        shrink go XOR-coded and their codec entries wait in `self.codecs` for their bucket's manifest. Tensors
        are coded `group_bytes` at a time, side by side on the sender's threads (`DeltaSender.encode`): the stage
        stream's tensors stay valid while later ones are asked for (`export.stage_tensors`)."""
        group, size = [], 0
        for name, t in source:
            group.append((name, t))
            size += t.numel() * t.element_size()
            if size >= group_bytes:
                yield from self._code_group(group, delta)
                group, size = [], 0
        yield from self._code_group(group, delta)

    def _code_group(self, group: list, delta: bool):
        if not group:
            return
        wire, section = self.delta.encode(group, delta=delta)
        for name, _ in group:
            if section and name in section["codec"]:
                self.codecs[name] = section["codec"][name]
        yield from wire

    def _forget_base(self) -> None:
        self.base_version = None
        if self.delta is not None:
            self.delta.forget()

    # -- data (the senders) --------------------------------------------------------------------------------------
    def _join(self, plan: dict, prune: bool = True) -> dict:
        """Close the groups of servers no longer in the plan (`prune`) or reopened in it; join the new ones.
        Returns {server: why} failures."""
        failed = {}
        for name in [n for n in self.groups if (prune and n not in plan) or plan.get(n, "keep") != "keep"]:
            self.groups.pop(name).close()
        for name, info in plan.items():
            if info == "keep":
                if name not in self.groups:
                    failed[name] = "this sender holds no group for it"
                continue
            try:
                self.groups[name] = join_group(
                    info["host"],
                    info["port"],
                    info["nonce"],
                    self.stage,
                    0,
                    1 + info["workers"],
                    info["backend"],
                    info["timeout_s"],
                    bind=self.bind,
                    op_timeout_s=min(info["op_timeout_s"], self.timeout_s),
                )
            except Exception as exc:  # noqa: BLE001
                failed[name] = f"sender of stage {self.stage} could not join: {type(exc).__name__}: {exc}"
        return failed

    def _broadcast(self, source, version: int, failed: dict, names: list, base=None) -> dict:
        """This stage's buckets (`source`: its (name, tensor) stream) into the live groups of `names`,
        double-buffered; every DP0/CP0 rank drives the gathers. With `base`, each bucket's manifest carries the
        codec entries of its XOR-coded tensors (`mgrpo.weights.delta`)."""
        stats = dict(bytes=0, buckets=0, export_s=0.0, transfer_s=0.0)
        inflight, t, on_wire = [], time.perf_counter(), None

        def settle(pending):
            for group_name, works in pending:
                try:
                    for w in works:
                        w.wait()
                except Exception as exc:  # noqa: BLE001  (a server gone mid-broadcast)
                    failed.setdefault(group_name, f"broadcast broke: {type(exc).__name__}: {exc}")

        def emit(bucket):
            nonlocal inflight, t, on_wire
            stats["export_s"] += time.perf_counter() - t
            t = time.perf_counter()
            if base is not None:
                codec = {n: self.codecs.pop(n) for n in bucket.manifest["names"] if n in self.codecs}
                bucket.manifest["delta"] = {"base": base, "codec": codec}
            started = self._start(failed, bucket, names)
            settle(inflight)  # the previous bucket; this one is on the wire while the next is gathered and packed
            inflight, on_wire = started, bucket  # (a tensor sent alone from its own memory lives until then)
            stats["transfer_s"] += time.perf_counter() - t
            stats["bytes"] += bucket.flat.numel()
            stats["buckets"] += 1
            t = time.perf_counter()

        packer = StreamPacker(self.buffers, self.bucket_bytes, "aligned")
        for bucket in pack_stream(source, packer, version):
            emit(bucket)
        if self.is_sender:
            t = time.perf_counter()
            settle(inflight)
            settle(self._start(failed, None, names))
            stats["transfer_s"] += time.perf_counter() - t
            if self.delta is not None:
                stats["delta"] = dict(self.delta.stats, base_host_bytes=self.delta.host_bytes, stage=self.stage)
        for name in failed:
            group = self.groups.pop(name, None)
            if group is not None:
                group.close()
        return stats

    def _start(self, failed: dict, bucket, names: list) -> list:
        """[(server, works)]: one bucket (None: the end of this stage's stream) set going into the live groups of
        `names`."""
        names = [n for n in self.groups if n not in failed and n in names]
        groups = [self.groups[n] for n in names]
        started = send_bucket(groups, bucket) if bucket is not None else send_end(groups)
        return [(n, works) for n, (_, works) in zip(names, started)]

    def probe(self, nbytes: int, bucket_bytes: int) -> dict:
        """The limit for benchmarks (single sender, after a send_model opened the groups): `nbytes` of plain
        broadcasts of one preallocated buffer into every group, no export, no manifest, no load."""
        import torch

        buf = torch.zeros(bucket_bytes, dtype=torch.uint8)
        pool = ThreadPoolExecutor(max_workers=len(self.groups))
        calls = [
            pool.submit(
                self.engine.post,
                r,
                "/mgrpo/collective/probe",
                {"bytes": nbytes, "bucket_bytes": bucket_bytes},
                self.timeout_s,
            )
            for r in self.engine.replicas
            if r.name in self.groups
        ]
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            n = min(left, bucket_bytes)
            for work in [g.broadcast(buf[:n]) for g in self.groups.values()]:
                work.wait()
            left -= n
        sent_s = time.perf_counter() - t0
        server = [c.result() for c in calls]
        pool.shutdown()
        return {"send_s": sent_s, "receive_s": max(x.get("probe_s", 0.0) for x in server), "bytes": nbytes}

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.buffers = [None, None]


def _nccl_version() -> str | None:
    """This trainer's NCCL (None without CUDA: a server on NCCL then refuses it in one line)."""
    import torch

    return ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
