"""Peak resident memory of a code block, sampled by a background thread (CPU runs have no CUDA counters).

Set MALLOC_MMAP_THRESHOLD_=131072 in the environment so freed buffers go back to the OS and RSS tracks
live memory rather than glibc's cached heap.
"""

from __future__ import annotations

import threading
import time

from mgrpo.parallel.watchdog import where

MB = 1 << 20


class PeakRSS:
    def __init__(self, interval_s: float = 0.0005):
        import psutil

        self.proc, self.interval, self.stop, self.peak, self.base = psutil.Process(), interval_s, False, 0, 0

    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def increase_mb(self) -> float:
        return (self.peak - self.base) / MB


class StepTimer:
    """Seconds per phase of a step: `with timer("rollout"): ...`; `timer.totals` maps phase -> seconds, and
    `elapsed()` the wall clock since the timer was made."""

    def __init__(self, phases=()):
        self.totals = {p: 0.0 for p in phases}  # phases listed up front are logged as 0 when skipped
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall-clock seconds since the timer was made (the step's clock, whatever ran between phases)."""
        return time.perf_counter() - self.started

    def __call__(self, phase: str):
        timer = self

        class _Span:
            def __enter__(self):
                where(phase)  # the step watchdog's heartbeat names it
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.totals[phase] = timer.totals.get(phase, 0.0) + time.perf_counter() - self.t0

        return _Span()
