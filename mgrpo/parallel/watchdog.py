"""No silent hangs (issue 54): a step watchdog on every rank.

A thread beside the training loop sends a heartbeat every few seconds and at each new phase: what this rank is doing (`where()`: the
phase the trainer's timers name, or a finer one such as `weight sync, bucket 17`) and when. Heartbeats go to the
run's c10d store through a client of its own (the same MASTER_ADDR:MASTER_PORT torch.distributed met on; no
shared file system needed across nodes, and the thread never shares a socket with the training loop). When a
step runs past `train.step_timeout_s`, every rank writes its Python stacks (`faulthandler`, all threads) and its
phase to `OUTPUT_DIR/hang/rank_N.txt`; rank 0 reads every heartbeat and prints ONE line: the step, the ranks that
went silent (no heartbeat for 3 intervals: stopped, dead, or stuck with the GIL held) with their host and last
phase, where the others wait, and where the reports went; then each rank exits with code 3 (torchrun ends the
others, and `--max-restarts` with `--resume latest` restarts from the last save). A rank that is itself stopped
cannot write its stacks: the line names it from its missing heartbeat.

The default timeout follows the run: 1800 s until a step has finished (start-up compiles, CUDA graphs), then
10 x the slowest step so far, at least 300 s. torch's own NCCL watchdog (its collective timeout, the flight
recorder: `nccl_diagnostics_env`) still applies under it. Peers: NeMo-RL's refit watchdogs, torchtitan's flight
recorder settings (`torchtitan/distributed/utils.py`); no peer writes every rank's stacks on a step timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from mgrpo.fsutil import pid_alive

EXIT_CODE = 3
FIRST_STEP_S = 1800.0  # the default limit until one step has finished
MIN_AUTO_S = 300.0
AUTO_FACTOR = 10.0
_NOW = {"phase": "start-up", "since": time.time()}
_CHANGED = threading.Event()  # a new phase: the watchdog's next heartbeat goes out at once


def where(phase: str) -> None:
    """Record what this rank does now; heartbeats and hang reports carry it."""
    _NOW["phase"], _NOW["since"] = phase, time.time()
    _CHANGED.set()


def nccl_diagnostics_env(hang_dir: str, environ: dict) -> dict:
    """NCCL settings for a run that must not hang silently, where the user has not set them: tear the process down
    on a collective error or timeout (async error handling 3, torch's default spelled out), the flight recorder's
    ring buffer on, and its dump on timeout into `hang_dir` (torch >= 2.5 reads TORCH_NCCL_*, newer torch also
    TORCH_FR_*; both are set, as torchtitan does)."""
    prefix = os.path.join(hang_dir, "nccl_trace_rank_")
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    return {k: v for k, v in wanted.items() if k not in environ}


class StepWatchdog:
    """`with watchdog.step(n): ...` around each training step. `timeout_s`: None = automatic (module docstring),
    0 = off. `store`: a c10d store client for heartbeats (None: this rank's own only, a single-rank run)."""

    def __init__(self, out_dir: str, rank: int, world: int, timeout_s=None, heartbeat_s=None, store=None, attempt=0):
        self.hang_dir = os.path.join(out_dir, "hang")
        self.rank, self.world, self.timeout_s, self.store = rank, world, timeout_s, store
        self.heartbeat_s = heartbeat_s or (min(10.0, max(0.5, timeout_s / 6)) if timeout_s else 10.0)
        self.key = f"mgrpo/heartbeat/{attempt}/"  # a torchrun restart starts with fresh heartbeats
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.slowest, self.step_no, self.step_t0 = 0.0, None, None
        self._stop = threading.Event()
        self._thread = None
        if timeout_s != 0:
            self._thread = threading.Thread(target=self._run, name="mgrpo-step-watchdog", daemon=True)
            self._thread.start()

    def limit(self) -> float:
        if self.timeout_s:
            return float(self.timeout_s)
        return FIRST_STEP_S if not self.slowest else max(MIN_AUTO_S, AUTO_FACTOR * self.slowest)

    @contextlib.contextmanager
    def step(self, n: int):
        self.step_no, self.step_t0 = n, time.monotonic()
        try:
            yield
        finally:
            self.slowest = max(self.slowest, time.monotonic() - self.step_t0)
            self.step_t0 = None

    def close(self) -> None:
        self._stop.set()
        _CHANGED.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)

    # the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            _CHANGED.wait(self.heartbeat_s)
            _CHANGED.clear()
            if self._stop.is_set():
                return
            self._beat()
            t0 = self.step_t0
            if t0 is not None and time.monotonic() - t0 > self.limit():
                self._fire(time.monotonic() - t0)
                return

    def _beat(self) -> None:
        if self.store is None:
            return
        beat = dict(rank=self.rank, host=self.host, pid=self.pid, phase=_NOW["phase"], time=time.time())
        with contextlib.suppress(Exception):  # a store that went away: rank 0's report says so
            self.store.set(f"{self.key}{self.rank}", json.dumps(beat))

    def _fire(self, elapsed: float) -> None:
        os.makedirs(self.hang_dir, exist_ok=True)
        mine = os.path.join(self.hang_dir, f"rank_{self.rank}.txt")
        with open(mine, "w") as f:
            f.write(
                f"rank {self.rank} on {self.host} (pid {self.pid}): step {self.step_no} ran {elapsed:.1f} s, past "
                f"{self.limit():g} s; phase {_NOW['phase']!r} for {time.time() - _NOW['since']:.1f} s\n\n"
            )
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        if self.rank == 0:
            line = self.report(elapsed)
            with open(os.path.join(self.hang_dir, "summary.txt"), "w") as f:
                f.write(line + "\n")
            print(line, file=sys.stderr, flush=True)
        else:
            time.sleep(2 * self.heartbeat_s)  # rank 0 reads the heartbeats before torchrun ends this process
        os._exit(EXIT_CODE)

    def heartbeats(self) -> dict:
        """{rank: last heartbeat dict, or None where none arrived} for every rank."""
        out = {}
        for r in range(self.world):
            try:
                known = self.store is not None and self.store.check([f"{self.key}{r}"])
                raw = self.store.get(f"{self.key}{r}") if known else None
            except Exception:  # noqa: BLE001  (the store is gone: nothing known of the others)
                raw = None
            out[r] = json.loads(raw) if raw else None
        out[self.rank] = dict(rank=self.rank, host=self.host, pid=self.pid, phase=_NOW["phase"], time=time.time())
        return out

    def gone_peers(self) -> str:
        """After a collective raised (a peer's connection closed): the ranks whose process is gone, by their last
        heartbeat's pid where it ran on this host, else the ranks silent for 3 intervals; one line."""
        now, gone, silent = time.time(), [], []
        for r, beat in sorted(self.heartbeats().items()):
            if r == self.rank or beat is None:
                continue
            if beat["host"] == self.host and not pid_alive(beat["pid"]):
                gone.append(f"rank {r} (pid {beat['pid']}, last in {beat['phase']!r})")
            elif now - beat["time"] > 3 * self.heartbeat_s:
                silent.append(f"rank {r} ({beat['host']}, silent for {now - beat['time']:.0f} s)")
        if not gone and not silent:
            return ""
        return f"collective failed in step {self.step_no}, phase {_NOW['phase']!r}: " + "; ".join(
            ([f"process gone: {', '.join(gone)}"] if gone else []) + ([", ".join(silent)] if silent else [])
        )

    def report(self, elapsed: float) -> str:
        now, silent_after = time.time(), 3 * self.heartbeat_s
        silent, waiting = [], []
        for r, beat in sorted(self.heartbeats().items()):
            if beat is None:
                silent.append(f"rank {r} (no heartbeat ever)")
            elif now - beat["time"] > silent_after:
                silent.append(
                    f"rank {r} ({beat['host']}, pid {beat['pid']}) silent for {now - beat['time']:.0f} s, "
                    f"last in {beat['phase']!r}"
                )
            else:
                waiting.append(f"{r}:{beat['phase']}")
        who = "; ".join(silent) if silent else "no rank went silent (a collective that never completes?)"
        return (
            f"hang: step {self.step_no} ran past train.step_timeout_s={self.limit():g} s ({elapsed:.0f} s): {who}; "
            f"answering: {', '.join(waiting) or 'none'}; stacks in {self.hang_dir}/rank_N.txt"
        )


def heartbeat_store(timeout_s: float = 30.0):
    """A c10d store client of the watchdog's own on the rendezvous torch.distributed used (None without one)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (dist.is_initialized() and dist.get_world_size() > 1 and addr and port):
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001  (heartbeats are diagnostics: the run goes on without them)
        print(f"warning: step watchdog heartbeats off: cannot reach the store at {addr}:{port}: {exc}", flush=True)
        return None


def start_watchdog(output_dir: str, timeout_s) -> StepWatchdog:
    """This rank's watchdog, after torch.distributed is up (heartbeats through the run's store)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    store = heartbeat_store() if timeout_s != 0 else None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return StepWatchdog(output_dir, rank, world, timeout_s, store=store, attempt=attempt)
