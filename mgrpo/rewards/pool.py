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
import threading
import time

FAILED = object()  # a call that raised or timed out


def _serve(conn, plugin_paths: list) -> None:
    """Worker loop: (module, name, args, kwargs) in, ("ok", value) or ("error", text) out."""
    from mgrpo.plugins import load_plugins

    load_plugins(plugin_paths)
    conn.send(("ready", None))  # the parent starts a call's clock only from here: start-up is not the call's
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
        self.ready = False

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
        self.lock = threading.Lock()  # one map at a time: partial rollout scores two batches from two threads
        atexit.register(self.close)

    def map(self, fn, items: list, timeout: float) -> list:
        """Values in order (FAILED where a call failed). Thread-safe: a map waits for one running in another thread
        (a worker's pipe carries one call at a time)."""
        with self.lock:
            return self._map(fn, items, timeout)

    def _map(self, fn, items: list, timeout: float) -> list:
        module, name = fn.__module__, fn.__qualname__
        out, todo, busy = [FAILED] * len(items), list(range(len(items))), {}
        while todo or busy:
            if not self._start_ready():
                self.errors.append("reward workers failed to start (see the plugin files)")
                return out
            for w in self.workers:
                if w.ready and w not in busy and todo:
                    k = todo.pop(0)
                    args, kwargs = items[k]
                    w.conn.send((module, name, args, kwargs))
                    busy[w] = (k, time.monotonic() + timeout)
            waiting = [w.conn for w in busy] + [w.conn for w in self.workers if not w.ready]
            ready = mp.connection.wait(waiting, timeout=0.05)
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

    def _start_ready(self, attempts: int = 3) -> bool:
        """Mark workers whose start-up finished; replace ones that died starting. False after `attempts` deaths
        in a row (a plugin that cannot load): the calls then fail instead of looping."""
        for w in list(self.workers):
            while not w.ready and w.conn.poll():
                try:
                    w.ready = w.conn.recv()[0] == "ready"
                except EOFError:
                    self.start_failures = getattr(self, "start_failures", 0) + 1
                    if self.start_failures > attempts:
                        return False
                    self._replace(w)
                    break
        if any(w.ready for w in self.workers):
            self.start_failures = 0
        return True

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
_SHARED_LOCK = threading.Lock()


def shared_pool(workers: int, plugins=()) -> RewardPool:
    """One pool per process (started on first use, its workers kept across steps)."""
    key = (int(workers), tuple(plugins))
    with _SHARED_LOCK:
        if key not in _SHARED:
            for old in _SHARED.values():
                old.close()
            _SHARED.clear()
            _SHARED[key] = RewardPool(workers, list(plugins))
        return _SHARED[key]
