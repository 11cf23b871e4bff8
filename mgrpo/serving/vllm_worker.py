"""Mixed into vLLM's worker (`worker_extension_cls`): `WeightReceiver` takes one weight version from the
colocated trainer (`serving/shm_receiver.py` holds the protocol, free of vLLM), `FileReceiver` one staged by the
rollout server as bucket files; both load with vLLM's own `reload_weights`. Importing this module also applies
the CPU idle-spin fix and registers mgrpo's collective weight-transfer backend in the worker.
"""

from __future__ import annotations

import os
import time

import torch

from mgrpo.serving.shm_receiver import receive_weights
from mgrpo.serving.vllm_moe import repack_cpu_experts
from mgrpo.serving.vllm_settings import test_load_delay
from mgrpo.weights.bucket import BucketError, ManifestCheck, read_bucket


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
        """One update from `SharedMemoryTransport` (`serving/shm_receiver.py`). Never raises into the engine core."""
        return receive_weights(self, channel, token, expected, optional)


class FileReceiver:
    def mgrpo_weights_digest(self) -> dict:
        """xxh3_128 over every parameter (name, dtype, shape, bytes) of this worker's model, in name order."""
        import xxhash

        h = xxhash.xxh3_128()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            t = p.detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return {"digest": h.hexdigest()}

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
