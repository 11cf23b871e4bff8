"""The shared-memory transport's control socket has a deadline: an engine that takes every bucket and then never
answers fails the update within rollout.request_timeout_s, naming the engine; it does not block the run forever.
The engine here is a scripted stand-in that speaks the transport's wire (this tests the transport, not vLLM)."""

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from mgrpo.weights import local_rpc
from mgrpo.weights.sync import WeightSyncError
from mgrpo.weights.transports.shared_memory import SharedMemoryTransport


def silent_engine(tmp_dir: str, answers: bool):
    """Receives the update, connects to the weight channel, takes every bucket, acknowledges them on the channel,
    and then (answers=False) never sends its receipt on the control socket."""
    engine = SimpleNamespace(
        name="stand-in",
        dir=tmp_dir,
        token=local_rpc.new_token(),
        dtype="float32",
        socket=os.path.join(tmp_dir, "engine.sock"),
    )
    listener = local_rpc.listener(engine.socket)

    def serve():
        ctl, _ = listener.accept()
        update = local_rpc.recv(ctl)
        data = local_rpc.connect(update["channel"], timeout=30)
        local_rpc.send(data, {"hello": engine.token})
        while "end" not in local_rpc.recv(data):
            pass
        local_rpc.send(data, {"ok": True})
        if answers:
            local_rpc.send(ctl, {"ok": True, "result": {"staged_at": time.time()}})
        time.sleep(5)
        ctl.close()
        data.close()

    threading.Thread(target=serve, daemon=True).start()
    return engine, listener


@pytest.mark.parametrize("answers", [True, False])
def test_a_silent_engine_fails_the_update_within_its_deadline(tmp_path, answers):
    engine, listener = silent_engine(str(tmp_path), answers)
    transport = SharedMemoryTransport(engine, 1 << 16, ring=0, buffer_kind="posix", update_timeout_s=1.5)
    tensors = [(f"w{i}", torch.randn(64, 64)) for i in range(6)]
    t0 = time.time()
    try:
        if answers:
            receipt = transport.send(tensors, version=1)
            assert receipt["buckets_sent"] >= 2
        else:
            with pytest.raises(WeightSyncError, match="stand-in did not answer weight version 1 within 1.5 s"):
                transport.send(tensors, version=1)
    finally:
        transport.close()
        listener.close()
    took = time.time() - t0
    print(f"answers={answers}: {took:.2f} s")
    assert took < 4
