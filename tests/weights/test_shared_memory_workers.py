"""`SharedMemoryTransport` feeding an engine with two workers (what a colocated vLLM engine at
tensor_parallel_size 2 has): two real worker processes run the engine side of the protocol
(`mgrpo/serving/shm_receiver.py`, the code vLLM's worker runs) and an engine stand-in combines their results as
`serving/vllm_child.py` does (`worker_outcome`). Buffers are POSIX shared memory; 20 KiB buckets, 3 tensors each.

- every worker gets every tensor bitwise, staged (ring 0) and streamed (ring 2), with one worker slow;
- ring order: a slot is written again only once every worker has freed it (negative control: the old rule, one
  worker's free, corrupts what the slow worker still reads);
- staged, two-phase: a bucket withheld from one worker is refused there and nothing loads anywhere (not poisoned);
- streamed: one worker failing mid-load poisons the engine, and the next update is refused in one line;
- a worker that never connects is named.
"""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from mgrpo.serving.shm_receiver import worker_outcome
from mgrpo.weights import local_rpc
from mgrpo.weights.sync import WeightSyncError
from mgrpo.weights.transports.shared_memory import SharedMemoryTransport

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "shm_worker.py")
BUCKET = 20 << 10
NAMES = [f"model.layers.{i}.mlp.w{j}" for i in range(8) for j in range(3)]  # 24 tensors of 6.4 KiB


def weights(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {name: torch.randn(50, 32, generator=g) for name in NAMES}


class TwoWorkerEngine:
    """The engine process's part of an update: pass the channel to every worker, wait for all, combine."""

    name, dtype = "stand-in#0", "float32"

    def __init__(self, tmp, workers: int = 2, started: int = 2):
        self.tmp, self.workers = tmp, workers
        self.dir = local_rpc.private_dir("mgrpo-test-")
        self.socket, self.token = os.path.join(self.dir, "engine.sock"), local_rpc.new_token()
        self.expected = {n: [[50, 32], "float32"] for n in NAMES}
        self.poisoned, self.options, self.received = None, [{}] * started, []
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.procs = [
            subprocess.Popen(
                [sys.executable, WORKER, str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            for r in range(started)
        ]
        assert all(json.loads(p.stdout.readline())["ready"] for p in self.procs)
        self.listener = local_rpc.listener(self.socket)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                msg = local_rpc.recv(conn)
                if self.poisoned:
                    local_rpc.send(
                        conn, {"ok": False, "error": f"engine is poisoned by an earlier update: {self.poisoned}"}
                    )
                    continue
                outs = [str(self.tmp / f"w{r}-v{msg['version']}.safetensors") for r in range(len(self.procs))]
                for r, p in enumerate(self.procs):
                    cmd = dict(channel=msg["channel"], token=self.token, expected=self.expected, out=outs[r])
                    p.stdin.write(json.dumps(dict(cmd, **self.options[r])) + "\n")
                    p.stdin.flush()
                results = [json.loads(p.stdout.readline()) for p in self.procs]
                self.received = [load_file(o) for o in outs]
                error, self.poisoned = worker_outcome(results)
                result = dict(results[0].get("receipt") or {}, staged_at=results[0].get("staged_at"))
                try:  # the trainer may have given up already (a worker that never connected)
                    local_rpc.send(
                        conn,
                        {"ok": False, "error": self.poisoned or error} if error else {"ok": True, "result": result},
                    )
                except OSError:
                    pass

    def close(self):
        self.listener.close()
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = TwoWorkerEngine(tmp_path_factory.mktemp("shm_workers"))
    yield e
    e.close()


def push(engine, version: int, ring: int, options=None, cls=SharedMemoryTransport, **kw):
    engine.options = options or [{}, {}]
    t = cls(engine, BUCKET, ring=ring, buffer_kind="posix", update_timeout_s=60, **kw)
    try:
        return t.send(iter(weights(version).items()), version)
    finally:
        t.close()


def same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("ring", [0, 2])
def test_every_worker_gets_every_tensor_bitwise(engine, ring):
    receipt = push(engine, 10 + ring, ring, options=[{}, {"delay": 0.01}])
    assert receipt["buckets_sent"] == 8 and engine.poisoned is None
    assert all(same(got, weights(10 + ring)) for got in engine.received)


class OneFreeReleases(SharedMemoryTransport):
    """The rule of a one-worker engine: the first worker's free returns the slot."""

    def _slot_released(self, frees: int, workers: int) -> bool:
        return frees >= 1


def test_a_slot_returned_after_one_workers_free_corrupts_the_slow_worker(engine):
    """Negative control for the ring order: the slow worker reads buckets the trainer has already overwritten."""
    push(engine, 20, 2, options=[{}, {"delay": 0.05}], cls=OneFreeReleases)
    assert not same(engine.received[1], weights(20))


class WithholdFromWorker1(SharedMemoryTransport):
    def _post(self, worker: int, sock, msg: dict) -> None:
        if worker == 1 and msg.get("bucket", {}).get("index") == 3:
            return
        super()._post(worker, sock, msg)


def test_a_staged_update_refused_by_one_worker_loads_on_none(engine):
    with pytest.raises(WeightSyncError) as err:
        push(engine, 30, 0, cls=WithholdFromWorker1)
    print(err.value)
    assert "never arrived" in str(err.value) and "old weights still serve" in str(err.value)
    assert engine.poisoned is None
    assert engine.received == [{}, {}], "nothing was loaded anywhere: the old weights still serve on both workers"
    push(engine, 31, 0)
    assert all(same(got, weights(31)) for got in engine.received)


def test_a_streamed_update_failing_on_one_worker_poisons_the_engine(engine):
    with pytest.raises(
        WeightSyncError, match="2 of 2 workers failed the update: .*worker 1 failed while loading tensor 5"
    ):
        push(engine, 40, 2, options=[{}, {"fail_after": 5}])
    with pytest.raises(WeightSyncError, match="refused the update: engine is poisoned"):
        push(engine, 41, 2)
    engine.poisoned = None  # what a restart of the engine gives


def test_a_worker_that_never_connects_is_named(tmp_path):
    engine = TwoWorkerEngine(tmp_path, workers=3, started=2)
    try:
        engine.options = [{}, {}]
        t = SharedMemoryTransport(engine, BUCKET, ring=0, buffer_kind="posix", accept_timeout_s=3)
        with pytest.raises(WeightSyncError, match=r"2 of its 3 workers connected .*missing ranks \[2\]"):
            t.send(iter(weights(50).items()), 50)
        t.close()
    finally:
        engine.close()
