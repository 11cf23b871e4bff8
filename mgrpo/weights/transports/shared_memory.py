"""`SharedMemoryTransport`: weights to a colocated engine's worker through buffers both processes map.

The trainer copies each exported tensor once into a buffer (cast to the engine's dtype on the way); the worker
hands views of it to vLLM's `reload_weights`. POSIX shared memory on CPU, CUDA IPC on GPU (`transports/buffers.py`).

`ring=0` (the CPU default) keeps one buffer per bucket, so the engine checks the whole update before loading any
of it (all or nothing); `ring=k` cycles k buffers and the worker loads buckets as they arrive (bounded memory; the
GPU default is 2). Buffers stay allocated between updates (first-touch page faults are paid once).

Per update: an `update` request on the engine's control socket; meanwhile this side packs buckets (the copy
overlaps the engine's dispatch of the request to its worker); the worker connects to this transport's data
socket, receives the bucket descriptions (JSON) and answers with its result; then the engine's receipt comes back
on the control socket.

An engine at tensor_parallel_size k has k workers, and each connects: every worker reads every bucket (vLLM's
`load_weights` takes the full HF tensors and keeps its own shard, as verl's colocated IPC receiver does:
`verl/workers/rollout/vllm_rollout/utils.py`), so one buffer serves all of them and a ring slot comes back only
when every worker has freed it. A staged update (everything fits the ring) is two-phase across workers: each
checks every bucket, and loading begins only once all have said `checked` (any refusal aborts all: the old
weights keep serving everywhere). A streamed update loads as it goes, so a worker that fails leaves the engine
poisoned (the engine process decides, from every worker's result: `serving/vllm_child.py`).
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from typing import Iterable

import torch

from mgrpo.weights import local_rpc
from mgrpo.weights.bucket import align_up, digest, dtype_name, fits
from mgrpo.weights.sync import StreamSync, WeightSyncError
from mgrpo.weights.transports.buffers import BUFFER_KINDS, buffer_prefix


class _WorkerStopped(Exception):
    def __init__(self, msg: dict):
        super().__init__(msg.get("error", msg))
        self.msg = msg


class SharedMemoryTransport(StreamSync):
    def __init__(
        self,
        engine,
        bucket_bytes: int,
        ring: int | None = None,
        buffer_kind: str | None = None,
        checksum: bool = False,
        accept_timeout_s: float = 300.0,
        update_timeout_s: float = 600.0,
    ):
        self.engine, self.bucket_bytes, self.checksum = engine, int(bucket_bytes), checksum
        self.workers = int(getattr(engine, "workers", 1))  # vLLM workers of the engine: its tensor_parallel_size
        self.kind = buffer_kind or ("cuda_ipc" if torch.cuda.is_available() else "posix")
        self.ring = (0 if self.kind == "posix" else 2) if ring is None else ring
        if self.ring == 1:
            raise ValueError(
                "a ring of 1 buffer cannot stream (the worker holds one while the next is written); "
                "use 0 (whole update staged) or >= 2"
            )
        self.channel = os.path.join(engine.dir, f"weights-{local_rpc.new_token()[:8]}.sock")
        self.listener = local_rpc.listener(self.channel)
        self.prefix = buffer_prefix(os.getpid(), engine.token)
        self.buffers: list = []
        self.fences: list = []  # per slot: the trainer's copies into it are complete before it is described
        self.accept_timeout_s = accept_timeout_s
        self.update_timeout_s = update_timeout_s  # the engine's receipt (after its load) must come within this

    def _buffer(self, slot: int, nbytes: int):
        while len(self.buffers) <= slot:
            self.buffers.append(None)
            self.fences.append(None)
        buf = self.buffers[slot]
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.close()
            size = max(self.bucket_bytes, nbytes)
            buf = BUFFER_KINDS[self.kind](f"{self.prefix}-{slot}-{size}", size)
            self.buffers[slot] = buf
            self.fences[slot] = buf.fence()
        return buf

    def _accept(self, ctl) -> list:
        """Every worker's connection in rank order, or the engine's early error reply (e.g. it is poisoned)."""
        deadline, socks = time.monotonic() + self.accept_timeout_s, {}
        with selectors.DefaultSelector() as sel:  # poll/epoll: select() fails on descriptors above 1023
            sel.register(self.listener, selectors.EVENT_READ)
            sel.register(ctl, selectors.EVENT_READ)
            while len(socks) < self.workers:
                ready = [key.fileobj for key, _ in sel.select(max(0.0, deadline - time.monotonic()))]
                if ctl in ready:
                    reply = local_rpc.recv(ctl)
                    for sock in socks.values():
                        sock.close()
                    raise WeightSyncError(f"engine {self.engine.name} refused the update: {reply.get('error', reply)}")
                if not ready:
                    for sock in socks.values():
                        sock.close()
                    raise WeightSyncError(
                        f"engine {self.engine.name}: {len(socks)} of its {self.workers} workers connected to the "
                        f"weight channel within {self.accept_timeout_s:g} s (missing ranks "
                        f"{sorted(set(range(self.workers)) - set(socks))})"
                    )
                data, _ = self.listener.accept()
                data.settimeout(self.accept_timeout_s)
                hello = local_rpc.recv(data)
                if hello.get("hello") != self.engine.token:
                    data.close()
                    raise WeightSyncError("a process without the engine's token connected to the weight channel")
                socks[int(hello.get("rank", len(socks)))] = data
        return [socks[r] for r in sorted(socks)]

    def send(self, named_tensors: Iterable[tuple], version: int, reset_cache: bool = True) -> dict:
        """Push one weight version; returns the engine's receipt with timings. Raises WeightSyncError (after
        draining `named_tensors`, which every rank drives) if the engine rejects or fails the update."""
        t0, wall0 = time.perf_counter(), time.time()
        stream = iter(named_tensors)
        ctl = local_rpc.connect(self.engine.socket, timeout=self.update_timeout_s)
        link = {"socks": None}

        def workers():
            if link["socks"] is None:
                link["socks"] = self._accept(ctl)
            return link["socks"]

        try:
            local_rpc.send(
                ctl,
                {
                    "op": "update",
                    "token": self.engine.token,
                    "version": version,
                    "channel": self.channel,
                    "reset_cache": reset_cache,
                    # requests in flight: finish first, or held and continued on the new weights (partial)
                    "in_flight": getattr(self.engine, "in_flight", "finish"),
                },
            )
            try:
                result, stats = self._stream(stream, workers, version)
            finally:
                for sock in link["socks"] or ():
                    sock.close()
            reply = local_rpc.recv(ctl)
        except (WeightSyncError, socket.timeout) as exc:
            for _ in stream:  # the export is a collective every rank must finish
                pass
            if isinstance(exc, socket.timeout):
                raise WeightSyncError(
                    f"engine {self.engine.name} did not answer weight version {version} within "
                    f"{self.update_timeout_s:g} s (rollout.request_timeout_s)"
                ) from None
            raise
        finally:
            ctl.close()
        for _ in stream:
            pass
        if not reply.get("ok"):
            raise WeightSyncError(f"engine {self.engine.name}: {reply.get('error') or result.get('error')}")
        if getattr(self.engine, "awaiting_push", False):
            self.engine.awaiting_push = False  # a restarted engine holds the current weights: it serves again
        receipt = dict(reply["result"], **stats, send_total_s=time.perf_counter() - t0)
        # this transport's own time: until the engine holds every bucket, checked, and vLLM's load step begins
        receipt["to_load_s"] = receipt.pop("staged_at") - wall0
        return receipt

    def _slot_released(self, frees: int, workers: int) -> bool:
        """A ring slot is written again only once every worker has handed it back."""
        return frees == workers

    def _post(self, worker: int, sock, msg: dict) -> None:
        """One message to one worker (a test withholds a bucket from one worker here)."""
        local_rpc.send(sock, msg)

    def _stream(self, stream, workers, version: int) -> tuple:
        """Pack `stream` into buffers; deliver bucket descriptions to every worker (`workers()` connects on first
        use, so packing starts before they have connected); return (the workers' result, timings)."""
        target = getattr(torch, self.engine.dtype)
        free = list(range(self.ring)) if self.ring else None
        freed: dict = {}  # slot -> workers that have handed it back
        outbox, index, copy_s, wait_s, nbytes = [], 0, 0.0, 0.0, 0
        cur = {"items": [], "used": 0, "slot": None}
        state = {"streamed": False}

        def deliver():
            socks = workers()
            for msg in outbox:
                for i, sock in enumerate(socks):
                    self._post(i, sock, msg)
            outbox.clear()
            return socks

        def next_message(socks, done=()) -> tuple:
            """(worker index, message) from whichever worker not in `done` speaks first (a worker that has sent
            its result closes its end: its socket reads as ready, at its end)."""
            with selectors.DefaultSelector() as sel:
                for i, sock in enumerate(socks):
                    if i not in done:
                        sel.register(sock, selectors.EVENT_READ, i)
                ready = sel.select(self.update_timeout_s)
            if not ready:
                raise socket.timeout()
            i = ready[0][0].data
            return i, local_rpc.recv(socks[i])

        def take_slot():
            nonlocal wait_s
            if not self.ring:
                return index
            while not free:
                socks = deliver()
                t = time.perf_counter()
                _, msg = next_message(socks)
                wait_s += time.perf_counter() - t
                if "free" not in msg:
                    raise _WorkerStopped(msg)
                slot = msg["free"]
                freed[slot] = freed.get(slot, 0) + 1
                if self._slot_released(freed[slot], len(socks)):
                    free.append(slot)
                    del freed[slot]
            return free.pop(0)

        def flush():
            nonlocal index
            slot, buf = cur["slot"], self.buffers[cur["slot"]]
            names, dtypes, shapes, offsets, sizes = (list(x) for x in zip(*cur["items"]))
            manifest = dict(
                version=version,
                index=index,
                count=0,
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                offsets=offsets,
                nbytes=sizes,
                sha256="",
            )
            self.fences[slot].wait()  # the copies into this slot are done before any worker may read it
            if self.checksum:
                manifest["sha256"] = digest(buf.view[: cur["used"]], manifest)
            need_free = bool(self.ring) and not free
            state["streamed"] |= need_free
            outbox.append(
                {
                    "bucket": manifest,
                    "buffer": buf.describe(),
                    "used": cur["used"],
                    "slot": slot,
                    "need_free": need_free,
                }
            )
            index += 1
            cur.update(items=[], used=0, slot=None)

        try:
            for name, t in stream:
                dtype = target if t.is_floating_point() else t.dtype
                n = t.numel() * dtype.itemsize
                if cur["items"] and not fits(
                    cur["used"], n, self.buffers[cur["slot"]].nbytes
                ):  # bucket.cut_buckets' rule
                    flush()
                if cur["slot"] is None:
                    cur["slot"] = take_slot()
                    self._buffer(cur["slot"], n)
                buf, off = self.buffers[cur["slot"]], align_up(cur["used"])
                tc = time.perf_counter()
                buf.view[off : off + n].view(dtype).view(t.shape).copy_(t)
                self.fences[cur["slot"]].record()
                copy_s += time.perf_counter() - tc
                cur["items"].append((name, dtype_name(dtype), list(t.shape), off, n))
                cur["used"], nbytes = off + n, nbytes + n
            if cur["items"]:
                flush()
            outbox.append({"end": index})
            socks = deliver()
            msg = self._finish(socks, next_message, staged=not state["streamed"])
        except _WorkerStopped as stop:
            msg = stop.msg
        except socket.timeout:
            msg = {"ok": False, "error": f"a worker did not answer within {self.update_timeout_s:g} s"}
        except (OSError, local_rpc.RpcError) as exc:
            msg = {"ok": False, "error": f"weight channel broke: {exc}"}
        return msg, {"copy_s": copy_s, "wait_s": wait_s, "bytes": nbytes, "buckets_sent": index}

    def _finish(self, socks, next_message, staged: bool) -> dict:
        """Staged: every worker says `checked` (or why not); all load, or none. Then every worker's result (late
        `free` notes may come first); the first failure, or worker 0's result."""
        results: dict = {}
        if staged:
            verdicts: dict = {}
            while len(verdicts) + len(results) < len(socks):
                i, msg = next_message(socks, {*verdicts, *results})
                if "checked" in msg:
                    verdicts[i] = msg
                elif "ok" in msg:
                    results[i] = msg
            go = not results
            for i in verdicts:
                local_rpc.send(socks[i], {"load": go})
        while len(results) < len(socks):
            i, msg = next_message(socks, results)
            if "ok" in msg:
                results[i] = msg
        failed = [results[i] for i in sorted(results) if not results[i].get("ok")]
        return failed[0] if failed else results[0]

    def close(self) -> None:
        for buf in self.buffers:
            if buf is not None:
                buf.close()
        self.buffers, self.fences = [], []
        self.listener.close()
        if os.path.exists(self.channel):
            os.unlink(self.channel)
