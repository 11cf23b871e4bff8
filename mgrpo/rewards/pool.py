"""Rewards that can hang run here: worker processes (spawned, so nothing of the trainer's threads or process
groups is inherited) that each take one call at a time, under a per-call timeout. A call past its timeout gets
its worker killed and replaced, and counts as a failed sample; the step goes on.

Why processes: math-verify bounds its own work with SIGALRM, which only works in a main thread, and a Python
thread cannot be stopped. A worker's main thread can use SIGALRM, and a worker can be killed.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import multiprocessing.connection
import time

FAILED = object()  # a call that raised or timed out


def _serve(conn, plugin_paths: list) -> None:
    """Worker loop: (module, name, args, kwargs) in, ("ok", value) or ("error", text) out."""
    from mgrpo.plugins import load_plugins

    load_plugins(plugin_paths)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(*args, **kwargs)))
        except Exception as exc:  # noqa: BLE001  (the parent marks the sample failed)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx, plugin_paths: list):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, plugin_paths), daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class RewardPool:
    """`workers` processes; `map(fn, items, timeout)` runs fn(*item_args, **item_kwargs) for every item and
    returns values in order, FAILED where a call raised or ran past `timeout` seconds."""

    def __init__(self, workers: int = 2, plugin_paths: list | None = None):
        self.ctx = mp.get_context("spawn")
        self.plugin_paths = list(plugin_paths or [])
        self.workers = [_Worker(self.ctx, self.plugin_paths) for _ in range(max(1, workers))]
        self.killed, self.errors = 0, []
        atexit.register(self.close)

    def map(self, fn, items: list, timeout: float) -> list:
        module, name = fn.__module__, fn.__qualname__
        out, todo, busy = [FAILED] * len(items), list(range(len(items))), {}
        while todo or busy:
            for w in self.workers:
                if w not in busy and todo:
                    k = todo.pop(0)
                    args, kwargs = items[k]
                    w.conn.send((module, name, args, kwargs))
                    busy[w] = (k, time.monotonic() + timeout)
            ready = mp.connection.wait([w.conn for w in busy], timeout=0.05)
            for w in list(busy):
                k, deadline = busy[w]
                if w.conn in ready:
                    try:
                        status, value = w.conn.recv()
                    except EOFError:  # the worker died mid-call
                        status, value = "error", "reward worker exited"
                    if status == "ok":
                        out[k] = value
                    else:
                        self.errors.append(value)
                    del busy[w]
                    if status == "error" and value == "reward worker exited":
                        self._replace(w)
                elif time.monotonic() > deadline:
                    self.errors.append(f"timed out after {timeout:g} s")
                    del busy[w]
                    self._replace(w)
        return out

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.killed += 1
        self.workers[self.workers.index(w)] = _Worker(self.ctx, self.plugin_paths)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
        atexit.unregister(self.close)


_SHARED: dict = {}


def shared_pool(workers: int, plugins=()) -> RewardPool:
    """One pool per process (started on first use, its workers kept across steps)."""
    key = (int(workers), tuple(plugins))
    if key not in _SHARED:
        for old in _SHARED.values():
            old.close()
        _SHARED.clear()
        _SHARED[key] = RewardPool(workers, list(plugins))
    return _SHARED[key]
