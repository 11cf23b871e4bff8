"""Stopping a run by hand: Ctrl-C, and deadlines that never swallow it.

One Ctrl-C raises KeyboardInterrupt where the run is: the step in progress is abandoned (nothing half-trained is
logged or saved), then the launcher stops cleanly (an asynchronous save in flight is finished, engines and their
processes end, the metrics so far stay) and exits 130. A second Ctrl-C during that exits 130 at once.

Deadlines on async calls use `asyncio.timeout` (Python 3.11+): 3.11's `asyncio.wait_for` returns the inner result
when it completes in the same loop iteration as a cancellation and drops the cancellation (cpython gh-86296), which
is how asyncio's own Ctrl-C handling (a cancellation of the main task) got lost mid-rollout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a job stopped by Ctrl-C


async def within(awaitable, seconds: float):
    """`await awaitable`, raising TimeoutError past `seconds`, never dropping a cancellation."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)  # Python 3.10


def _now(signum, frame) -> None:
    """Exit at once, and take this process's children along (engine processes, reward workers, the manager
    process megatron's checkpointing starts): skipped finalizers would leave them running, holding our pipes."""
    os.write(2, b"\nmgrpo: second Ctrl-C: exiting now\n")
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001  (exiting regardless)
        pass
    os._exit(EXIT_INTERRUPTED)


def _first(signum, frame) -> None:
    signal.signal(signal.SIGINT, _now)
    print(
        "\nmgrpo: Ctrl-C: stopping (the step in progress is dropped; engines and an async save in flight are "
        "closed first). Ctrl-C again to exit now",
        file=sys.stderr,
        flush=True,
    )
    raise KeyboardInterrupt


def handle_ctrl_c() -> bool:
    """Install the two-stage Ctrl-C handler (main thread only); True if installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, _first)
    return True
