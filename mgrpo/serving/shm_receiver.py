"""The colocated engine's side of `SharedMemoryTransport` (`weights/transports/shared_memory.py`), free of vLLM:
one weight version received over a local socket, bucket by bucket out of shared buffers, checked, and handed
to the worker's `reload_weights`. `serving/vllm_worker.py` mixes it into vLLM's worker; tests drive it in plain
processes (`tests/weights/shm_worker.py`).

All or nothing. The trainer has `ring` buffers. While the update fits in them (ring 0 = unlimited, the CPU
default) every bucket is checked first (manifest against this model: nothing unknown, nothing twice, shapes,
dtypes, sha256 when present) and the whole set for completeness; the worker then says `checked` and loads only
when the trainer answers `load` (it does once every worker of the engine has checked: one refusal leaves the old
weights serving on all of them). When the ring is full the buckets stream through `reload_weights` as they
arrive (bounded memory, for large models on GPU): a bucket that fails its check then leaves a half-loaded model,
so the worker reports `poisoned` and the engine refuses to serve until restarted.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from mgrpo.serving.vllm_moe import repack_cpu_experts
from mgrpo.weights import local_rpc
from mgrpo.weights.bucket import Bucket, BucketError, ManifestCheck
from mgrpo.weights.transports.buffers import open_buffer


def receive_weights(worker, channel: str, token: str, expected: dict, optional: list) -> dict:
    """One update into `worker` (has `reload_weights`, `model_runner.model`, `rank`); returns {ok, receipt |
    error, poisoned, load_s}. Never raises."""
    try:
        sock = local_rpc.connect(channel, timeout=600)
    except OSError as exc:
        return {"ok": False, "poisoned": False, "error": f"cannot reach the trainer's channel: {exc}"}
    buffers = {}
    try:
        local_rpc.send(sock, {"hello": token, "rank": int(getattr(worker, "rank", 0))})
        return _receive(worker, sock, buffers, expected, optional)
    except (OSError, local_rpc.RpcError) as exc:
        return {"ok": False, "poisoned": False, "cause": "peer", "error": f"weight channel broke before loading: {exc}"}
    finally:
        sock.close()
        for buf in buffers.values():
            buf.close()


def worker_outcome(results: list) -> tuple:
    """(error, poisoned) of an update from every worker's result: (None, None) when all loaded. A worker that
    loaded beside one that did not leaves the engine's shards on two versions: poisoned."""
    bad = sorted((r for r in results if not r.get("ok")), key=lambda r: r.get("cause") == "peer")
    if not bad:
        return None, None
    if any(r.get("poisoned") for r in bad) or len(bad) < len(results):
        return bad[0]["error"], f"{len(bad)} of {len(results)} workers failed the update: {bad[0]['error']}"
    return bad[0]["error"], None


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
    if receipt is not None:  # staged: load only once every worker of the engine has checked its copy
        local_rpc.send(sock, {"checked": True})
        if not local_rpc.recv(sock).get("load"):
            return _fail(
                sock,
                "another worker of this engine refused the update; old weights still serve",
                poisoned=False,
                cause="peer",
            )

    def weights():
        while pending:
            slot, bucket = pending.popleft()
            streaming = state["streaming"]
            on_gpu = False
            for name, tensor in bucket.tensors():
                # vLLM buffers a layer's tensors until the layer is complete: a slot handed back for reuse
                # must not be referenced, so streamed tensors are copied out of it first
                on_gpu |= tensor.is_cuda
                yield name, tensor.clone() if streaming else tensor
            if streaming and not state["ended"]:
                if on_gpu:  # the clones are queued on the stream: done before the trainer may overwrite the slot
                    torch.cuda.current_stream().synchronize()
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
            cause="peer" if isinstance(exc, (OSError, local_rpc.RpcError)) else "own",  # the trainer or a peer left
        )
    load_s = time.perf_counter() - t0
    out = {"ok": True, "receipt": receipt, "load_s": load_s, "streamed": state["streaming"], "staged_at": staged_at}
    try:  # loaded: the engine reads this result; the trainer may have stopped listening (another worker failed)
        local_rpc.send(sock, out)
    except OSError:
        pass
    return out


def _fail(sock, message: str, poisoned: bool, cause: str = "own") -> dict:
    """`cause`: "own" (this worker's check or load failed) or "peer" (the channel closed, another worker refused):
    the engine reports an own failure first."""
    out = {"ok": False, "error": message, "poisoned": poisoned, "cause": cause}
    try:
        local_rpc.send(sock, out)
    except OSError:
        pass
    return out
