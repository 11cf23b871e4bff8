"""Mixed into vLLM's worker (`worker_extension_cls`): receives one weight version from the trainer over a local
socket, bucket by bucket out of shared buffers, and loads it with vLLM's own `reload_weights`.

All or nothing. The trainer has `ring` buffers. While the update fits in them (ring 0 = unlimited, the CPU
default) every bucket is checked first (manifest against this model: nothing unknown, nothing twice, shapes,
dtypes, sha256 when present) and the whole set for completeness, and only then is anything loaded, so a
rejected update leaves the old weights serving. When the ring is full the buckets stream through
`reload_weights` as they arrive (bounded memory, for large models on GPU): a bucket that fails its check then
leaves a half-loaded model, so the worker reports `poisoned` and the engine refuses to serve until restarted.
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from mgrpo.serving.vllm_moe import repack_cpu_experts
from mgrpo.serving.vllm_settings import test_load_delay
from mgrpo.weights import local_rpc
from mgrpo.weights.bucket import Bucket, BucketError, ManifestCheck, read_bucket
from mgrpo.weights.transports.buffers import open_buffer


def _quiet_idle_spin(seconds: float) -> None:
    """vLLM's worker and engine core busy-poll their shared-memory queues for 1 s after every message before
    sleeping on a socket. On a CPU machine those cores belong to the trainer ranks and to the worker's own
    compute (measured on 2 cores: train step 0.39 s -> 1.25 s; a 376 MB weight copy 80 ms -> 0.6-1.4 s), so on
    CPU they spin only `seconds` (MGRPO_VLLM_IDLE_SPIN_S, default 0.005: on the main job 5 ms beat both 50 ms
    and 0.5 ms) before they sleep. Applied in the engine process (inherited by the engine core) and the worker."""
    from vllm.distributed.device_communicators import shm_broadcast

    original = shm_broadcast.SpinCondition.wait
    if getattr(original, "mgrpo_patched", False):
        return

    def wait(self, timeout_ms=None):
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, seconds)
        return original(self, timeout_ms)

    wait.mgrpo_patched = True
    shm_broadcast.SpinCondition.wait = wait


if not torch.cuda.is_available():
    _quiet_idle_spin(float(os.environ.get("MGRPO_VLLM_IDLE_SPIN_S", "0.005")))

# vLLM imports this module in each worker before it loads the model (and builds its weight-transfer engine)
from mgrpo.serving.collective_receiver import register as _register_collective  # noqa: E402

_register_collective()


class WeightReceiver:
    def mgrpo_receive_weights(self, channel: str, token: str, expected: dict, optional: list) -> dict:
        """One update; returns {ok, receipt | error, poisoned, load_s}. Never raises into the engine core."""
        try:
            sock = local_rpc.connect(channel, timeout=600)
        except OSError as exc:
            return {"ok": False, "poisoned": False, "error": f"cannot reach the trainer's channel: {exc}"}
        buffers = {}
        try:
            local_rpc.send(sock, {"hello": token})
            return _receive(self, sock, buffers, expected, optional)
        finally:
            sock.close()
            for buf in buffers.values():
                buf.close()


class FileReceiver:
    def mgrpo_collective_receipt(self) -> dict:
        """What the collective backend received and loaded in the last update (`collective_receiver.py`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "receipt", None) or {})

    def mgrpo_load_files(self, paths: list, expected: dict, optional: list) -> dict:
        """One update staged by the rollout server as bucket files (sha256 already checked there): every bucket
        is checked against this model and the whole set for completeness before anything is loaded; then
        vLLM's reload_weights reads the tensors straight out of the mapped files. Never raises into the core."""
        import mmap

        test_load_delay()
        check = ManifestCheck({k: (tuple(s), d) for k, (s, d) in expected.items()}, optional, receiver="rollout server")
        files, maps, buckets = [], [], []
        try:
            for path in paths:
                files.append(open(path, "rb"))
                maps.append(mmap.mmap(files[-1].fileno(), 0, access=mmap.ACCESS_COPY))
                bucket = read_bucket(maps[-1])
                bucket.verified = bucket.manifest.get("sha256")  # the server checked it as it arrived
                check.add(bucket)
                buckets.append(bucket)
            receipt = check.finish()
        except (OSError, BucketError, KeyError, TypeError, ValueError) as exc:
            return {
                "ok": False,
                "poisoned": False,
                "error": f"update rejected before loading, old weights still serve: {exc}",
            }
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_iterator=(item for b in buckets for item in b.tensors()))
            repack_cpu_experts(self.model_runner.model)
        except Exception as exc:  # noqa: BLE001
            return {
                "ok": False,
                "poisoned": True,
                "error": f"update failed while loading, the engine holds a mix "
                f"of versions: {type(exc).__name__}: {exc}",
            }
        finally:
            buckets.clear()
            for m in maps:
                try:
                    m.close()
                except BufferError:  # a tensor view still alive; the mapping goes with it
                    pass
            for f in files:
                f.close()
        return {"ok": True, "receipt": receipt, "load_s": time.perf_counter() - t0}


def _receive(worker, sock, buffers: dict, expected: dict, optional: list) -> dict:
    check = ManifestCheck({k: (tuple(s), d) for k, (s, d) in expected.items()}, optional, receiver="vLLM engine")
    pending: deque = deque()
    state = {"ended": False, "streaming": False}

    def next_bucket():
        msg = local_rpc.recv(sock)
        if "end" in msg:
            state["ended"] = True
            return
        desc = msg["buffer"]
        key = desc.get("path") or str(desc.get("handle"))
        if key not in buffers:
            buffers[key] = open_buffer(desc)
        bucket = Bucket(buffers[key].view[: msg["used"]], msg["bucket"])
        check.add(bucket)
        pending.append((msg["slot"], bucket))
        state["streaming"] |= bool(msg.get("need_free"))

    try:  # stage what fits in the trainer's ring; check everything before loading anything
        while not state["ended"] and not state["streaming"]:
            next_bucket()
        receipt = check.finish() if state["ended"] else None
    except (BucketError, KeyError, TypeError, ValueError) as exc:
        return _fail(sock, f"update rejected before loading, old weights still serve: {exc}", poisoned=False)

    def weights():
        while pending:
            slot, bucket = pending.popleft()
            streaming = state["streaming"]
            for name, tensor in bucket.tensors():
                # vLLM buffers a layer's tensors until the layer is complete: a slot handed back for reuse
                # must not be referenced, so streamed tensors are copied out of it first
                yield name, tensor.clone() if streaming else tensor
            if streaming and not state["ended"]:
                local_rpc.send(sock, {"free": slot})
                next_bucket()

    staged_at, t0 = time.time(), time.perf_counter()  # wall clock: the trainer times its side against it
    try:
        worker.reload_weights(weights_iterator=weights())
        repack_cpu_experts(worker.model_runner.model)
        receipt = receipt or check.finish()
    except Exception as exc:  # noqa: BLE001  (anything after loading began leaves a half-loaded model)
        return _fail(
            sock,
            f"update failed while loading, the engine holds a mix of versions: {type(exc).__name__}: {exc}",
            poisoned=True,
        )
    load_s = time.perf_counter() - t0
    out = {"ok": True, "receipt": receipt, "load_s": load_s, "streamed": state["streaming"], "staged_at": staged_at}
    local_rpc.send(sock, out)
    return out


def _fail(sock, message: str, poisoned: bool) -> dict:
    out = {"ok": False, "error": message, "poisoned": poisoned}
    try:
        local_rpc.send(sock, out)
    except OSError:
        pass
    return out
