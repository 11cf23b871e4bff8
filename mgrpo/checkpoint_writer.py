"""checkpoint.async_save's writer: one spawned process per rank that writes megatron's shards while training goes on.

Why not megatron's default (a writer forked from the trainer at each save): forking a process that runs gloo/NCCL and
OpenMP threads can leave the child stuck on a lock no thread will release; the trainer then waits in `join()`
forever (Megatron-LM issue 2422; NVIDIA's resiliency extension made a spawned worker its default for this). Our CI
met it once in ~30 async-save runs. Megatron's own spawned worker does not fit either: it reads the tensors where they
live (on CPU: the parameters the next optimizer step overwrites) and calls `torch.cuda.set_device` without a GPU.

So the trainer copies the shards to write into one shared-memory buffer per save (on GPU this copy is the device-to-host
copy megatron does anyway; it bounds what a save holds to one extra copy of the rank's shards), and hands the buffer
to the writer, which runs megatron's multi-process file writer on it. Results travel back on megatron's queue, so
megatron's finalize (metadata, errors raised on every rank) is unchanged."""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import os
import queue
import warnings

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

ALIGN = 64  # bytes: every tensor view in the shared buffer starts aligned for any dtype


def spawned_writer_queue() -> AsyncCallsQueue:
    """megatron's AsyncCallsQueue with the spawned, snapshotting writer below."""
    calls = AsyncCallsQueue(persistent=True)
    calls.persistent_caller = SpawnedWriter()
    calls.persistent_caller.start()  # its imports (~6 s of one core on CPU) overlap the first steps
    return calls


def snapshot(write_buckets: list) -> tuple:
    """Every tensor of the buckets copied into one shared-memory buffer (the trainer may change them next step); the
    buckets name each by (offset, dtype, shape). One buffer: one file descriptor, whatever the number of tensors."""
    sizes = [_aligned(t.numel() * t.element_size()) for _, _, (_, items) in write_buckets for _, t in items]
    buffer = torch.empty(max(sum(sizes), 1), dtype=torch.uint8).share_memory_()
    out, offset = [], 0
    for file_name, key, (byte_items, items) in write_buckets:
        slots = []
        for item, t in items:
            nbytes = t.numel() * t.element_size()
            buffer[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())  # on GPU: the D2H copy
            slots.append((item, (offset, t.dtype, tuple(t.shape))))
            offset += _aligned(nbytes)
        out.append((file_name, key, (byte_items, slots)))
    return buffer, out


def rebuild(buffer: torch.Tensor, buckets: list) -> list:
    """The writer's side of `snapshot`: each tensor its own storage over its bytes of the buffer (torch.save writes a
    tensor's whole storage, so views of the buffer would each write all of it)."""
    whole = memoryview(buffer.numpy())
    out = []
    for file_name, key, (byte_items, slots) in buckets:
        tensors = []
        for item, (offset, dtype, shape) in slots:
            numel = math.prod(shape)
            t = torch.empty(0, dtype=dtype)
            if numel:
                with warnings.catch_warnings():  # torch warns that any buffer handed to it may be written
                    warnings.simplefilter("ignore")
                    t = torch.frombuffer(whole, dtype=dtype, count=numel, offset=offset)
            tensors.append((item, t.view(shape)))
        out.append((file_name, key, (byte_items, tensors)))
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SpawnedWriter(PersistentAsyncCaller):
    """megatron's persistent caller (same request queue and close), fed snapshots instead of live tensors. The writer
    sends each save's results back with its completion, and megatron's finalize reads them from an in-process queue;
    a writer that died completes its save with an error, which finalize raises on every rank (no rank waits for ever).
    """

    def __init__(self):
        super().__init__()
        self.results: queue.Queue = queue.Queue()
        filesystem_async._results_queue = self.results  # where megatron's finalize reads each save's results
        self.in_flight, self.buffer = 0, None

    def start(self) -> None:
        if self.process is None:
            self.process = mp.get_context("spawn").Process(  # not a daemon: megatron's file writer forks its workers
                target=writer_loop, args=(self.queue, self.comp_q, os.getpid()), name="mgrpo-ckpt-writer"
            )
            self.process.start()
            atexit.register(self.close)  # runs before multiprocessing's exit hook, which would join a waiting writer

    def schedule_async_call(self, async_req) -> None:
        if async_req.async_fn is None:
            return  # nothing to write on this rank
        self.start()
        args = list(async_req.async_fn_args)  # (rank, write_buckets, results queue): results come back on comp_q
        self.buffer, args[1] = snapshot(args[1])  # held until written: the queue pickles it in a background thread
        args[2] = None
        self.queue.put((self.buffer, async_req._replace(async_fn_args=tuple(args), preload_fn=None)))
        self.in_flight += 1

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        while self.in_flight:
            try:
                _, result = self.comp_q.get(timeout=0.1) if blocking else self.comp_q.get_nowait()
            except queue.Empty:
                if self.process.is_alive():
                    if blocking:
                        continue
                    break
                result = RuntimeError(f"the checkpoint writer process exited with code {self.process.exitcode}")
            self.results.put(result)
            self.in_flight -= 1
            self.buffer = None
        return not self.in_flight if no_dist else self.sync_all_async_calls(int(self.in_flight > 0))

    def close(self, abort: bool = False) -> None:
        """Stop the writer after the write it has (abort: at once)."""
        if self.process is not None:
            if abort:
                self.process.kill()
            elif self.process.is_alive():
                self.queue.put("DONE")
            self.process.join()
            self.process = None


class _Collected:
    """Stands in for megatron's results queue inside the writer: keeps what its file writer reports."""

    value = None

    def put(self, value) -> None:
        self.value = value


def writer_loop(requests, done, trainer_pid: int) -> None:
    """The writer process: megatron's multi-process file writer, one request at a time, until 'DONE' or until the
    trainer is gone (killed: nobody will send 'DONE')."""
    while True:
        try:
            request = requests.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != trainer_pid:
                return
            continue
        if isinstance(request, str):
            requests.task_done()
            return
        buffer, request = request
        collected, args = _Collected(), list(request.async_fn_args)
        args[1], args[2] = rebuild(buffer, args[1]), collected
        try:
            request.async_fn(*args, **request.async_fn_kwargs)
        except Exception as e:  # megatron reports its file writers' errors itself; this is anything around them
            collected.value = RuntimeError(f"checkpoint writer: {type(e).__name__}: {e}")
        done.put((request.call_idx, collected.value))
        requests.task_done()
