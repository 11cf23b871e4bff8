"""mgrpo's backend in vLLM's weight-transfer factory (`--weight-transfer-config '{"backend": "mgrpo_collective"}'`,
registered by the worker extension at import): the worker side of `transports/collective.py`.

vLLM's four phases, as the rollout server drives them (`weight_routes_collective.py`):
  init_transfer_engine   join one group per trainer sender (the server's store, the nonce, this worker's rank)
  start_weight_update    forget whatever a failed update left
  update_weights         receive every sender's buckets, each checked against the model's manifest as it
                         arrives (nothing unknown, nothing twice, shapes, dtypes); nothing is loaded yet
  finish_weight_update   check the set is complete, then load it with vLLM's in-place `reload_weights`
A failure before the load leaves the old weights serving ("rejected"); a failure during it is reported as
"poisoned" (the engine may hold a mix). Staging the whole update costs a model's worth of memory per worker; with
`stream` (the server's --collective-stream, on by default with CUDA: a 72B model does not fit twice on a GPU) the
buckets go into `reload_weights` as they arrive, each still checked before it loads, and the completeness check
comes at the end: a failure then poisons the server. The built-in engines want CUDA; this one runs over gloo on
CPU and over NCCL on GPU with the same code (`collective_group.py`).

Deltas (`rollout.remote.delta`): one base per server, on its first worker (`DeltaBase`: the model's HF tensors in
the wire dtype, host memory; kept with `keep_base` from the last version loaded). A delta names its base: when the
first worker holds another one, every worker drains the broadcast and refuses before anything loads (`NEED_FULL`:
the trainer sends the whole version in the same push). A delta is small, so it is always staged, even with
`stream`: the first worker decodes every coded tensor into the base and checks its digest before anything loads
(a mismatch refuses, the old weights serve), then, as vLLM loads, shares each decoded tensor with the other workers
over the server's own process group (vLLM's world group: NCCL on GPU, gloo on CPU), in the same order on all.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from mgrpo.serving.vllm_moe import repack_cpu_experts
from mgrpo.serving.vllm_settings import test_load_delay
from mgrpo.weights.bucket import DTYPES, BucketError, ManifestCheck
from mgrpo.weights.delta import NEED_FULL, DeltaBase, NeedFull
from mgrpo.weights.transports.collective_group import join_group, receive_buckets

BACKEND = "mgrpo_collective"
REJECTED, POISONED = "update rejected before loading, old weights still serve", "update failed while loading"


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    nonce: str
    senders: int
    backend: str = "gloo"
    timeout_s: float = 60.0  # for the senders to join
    op_timeout_s: float = 600.0  # for one transfer (the server's --update-timeout-s)


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    version: int
    expected: dict = field(default_factory=dict)  # name -> [shape, dtype]
    optional: list = field(default_factory=list)
    probe_bytes: int = 0  # > 0: only time the wire (benchmarks): that many bytes into one preallocated buffer
    probe_bucket: int = 0
    stream: bool = False  # load each bucket as it arrives (bounded memory) instead of staging the whole update
    delta_base: int | None = None  # the buckets are deltas against this version (`mgrpo.weights.delta`)
    keep_base: bool = False  # keep what loads as the base of the next delta


class CollectiveReceiver(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.groups, self.buckets, self.check, self.receipt, self.probing = [], [], None, {}, False
        self.streamed, self.info, self.base, self.fresh = False, None, DeltaBase(), {}
        self.error = self.init_error = None

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        try:
            self._init(init_info)
            self.init_error = None
        except Exception as exc:  # noqa: BLE001  (never into the core: see `_failed`)
            self.init_error = f"{type(exc).__name__}: {exc}"

    def _init(self, init_info: CollectiveInitInfo) -> None:
        self.shutdown()
        rank, size = _worker_rank(), self.parallel_config.world_size
        self.groups = [
            join_group(
                init_info.host,
                init_info.port,
                init_info.nonce,
                s,
                1 + rank,
                1 + size,
                init_info.backend,
                init_info.timeout_s,
                bind=init_info.host,
                op_timeout_s=init_info.op_timeout_s,
            )
            for s in range(init_info.senders)
        ]

    def start_weight_update(self) -> None:
        self.buckets, self.check, self.receipt, self.probing, self.streamed = [], None, {}, False, False
        self.error = None
        self.fresh = {}  # a whole version's tensors, the next base (`keep_base`)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no device sync needed: nothing loaded yet

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        if self.error is None:
            try:
                self._receive(update_info)
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A phase that failed reports it in the receipt (`mgrpo_collective_receipt`) instead of raising: vLLM
        0.32's MultiprocExecutor.collective_rpc stops reading replies at the first worker that raised, so at TP > 1
        the other workers' replies would answer the server's next calls (measured: a digest answered by a
        receipt). Later phases of the update do nothing."""
        self.error = str(exc) if isinstance(exc, RuntimeError) else f"{REJECTED}: {type(exc).__name__}: {exc}"
        self.receipt = {"error": self.error}

    def _receive(self, update_info: CollectiveUpdateInfo) -> None:
        if not self.groups:
            why = f" ({self.init_error})" if self.init_error else ""
            raise RuntimeError(f"{REJECTED}: no trainer has joined (POST /mgrpo/collective/open first){why}")
        if update_info.probe_bytes:
            return self._probe(update_info.probe_bytes, update_info.probe_bucket)
        test_load_delay()
        t0, self.info = time.perf_counter(), update_info
        base = update_info.delta_base
        if base is not None and self._agree(self.base.version != base):  # drained: the senders finish
            self._drain()
            have = "no base" if self.base.version is None else f"version {self.base.version}"
            raise RuntimeError(
                f"{REJECTED}: {NEED_FULL}: a delta against version {base} arrived; the server has {have}"
            )
        self.check = ManifestCheck(
            {k: (tuple(s), d) for k, (s, d) in update_info.expected.items()},
            update_info.optional,
            receiver="rollout server (collective)",
        )
        if update_info.stream and base is None:  # a delta is small: staged, so it is checked before it loads
            return self._receive_and_load(t0)
        lock = threading.Lock()

        def take(sender, group):  # every sender (pipeline stage) at the same time, one thread each
            for bucket in receive_buckets(group):
                with lock:
                    self.check.add(bucket)
                    self.buckets.append((sender, bucket))

        try:
            with ThreadPoolExecutor(max_workers=len(self.groups)) as pool:
                for future in [pool.submit(take, s, g) for s, g in enumerate(self.groups)]:
                    future.result()
        except BucketError as exc:
            self.buckets = []
            raise RuntimeError(f"{REJECTED}: {exc}") from None
        except Exception as exc:  # noqa: BLE001  (a sender gone, a timeout: the groups are unusable)
            self.buckets = []
            self.shutdown()
            raise RuntimeError(
                f"{REJECTED}: the weight broadcast broke ({type(exc).__name__}: {exc}); the groups "
                f"are torn down, the trainer opens new ones"
            ) from None
        # the same order on every worker (the deltas' decoded tensors are shared in it)
        self.buckets = [b for _, b in sorted(self.buckets, key=lambda x: (x[0], x[1].manifest.get("index", 0)))]
        self.receipt = {"receive_s": time.perf_counter() - t0}

    def _drain(self) -> None:
        with ThreadPoolExecutor(max_workers=len(self.groups)) as pool:
            for future in [pool.submit(lambda g: sum(1 for _ in receive_buckets(g)), g) for g in self.groups]:
                future.result()

    def _kept(self, bucket) -> list:
        """A whole version's bucket as it loads; with `keep_base` the first worker keeps host copies as the next
        base (a bucket on the GPU stays there for the load)."""
        items = list(bucket.tensors())
        if self.info.keep_base and _world().rank_in_group == 0:
            self.fresh.update((n, t if t.device.type == "cpu" else t.cpu()) for n, t in items)
        return items

    def _decode_all(self) -> None:
        """The first worker decodes every staged delta bucket into the base, each digest checked; all workers
        agree on the outcome before anything loads (`NeedFull` on every worker if the first one refused)."""
        failed = None
        if _world().rank_in_group == 0:
            try:
                for bucket in self.buckets:
                    who = f"rollout server, bucket {bucket.manifest.get('index')}"
                    self.base.apply(bucket.manifest, bucket.tensors(), self.info.version, who=who)
            except NeedFull as exc:
                failed = exc
        if self._agree(failed is not None):
            raise failed or NeedFull("the server's first worker refused the delta")

    def _decoded(self):
        """(name, tensor) of every decoded tensor, in bucket order: the base's own on the first worker, shared
        with the others over the server's process group (one broadcast per tensor, as vLLM loads it)."""
        world = _world()
        for bucket in self.buckets:
            m = bucket.manifest
            codec = (m.get("delta") or {}).get("codec") or {}
            for name, dtype, shape in zip(m["names"], m["dtypes"], m["shapes"]):
                if world.world_size == 1:
                    yield name, self.base.base[name]
                    continue
                if name in codec:
                    dtype, shape = codec[name]["dtype"], codec[name]["shape"]
                if world.rank_in_group == 0:
                    t = self.base.base[name].to(world.device)
                else:
                    t = torch.empty(shape, dtype=DTYPES[dtype], device=world.device)
                world.broadcast(t, 0)
                yield name, t

    def _agree(self, flag: bool) -> bool:
        """The first worker's `flag`, on every worker of the server (its base decides)."""
        world = _world()
        if world.world_size == 1:
            return flag
        return bool(world.broadcast(torch.tensor([int(flag)], device=world.device), 0).item())

    def _loaded(self, ok: bool) -> None:
        """After a load: the base holds the version that loaded (with `keep_base`), or nothing."""
        info = self.info
        if not ok or not info.keep_base:
            self.base.forget()
        elif info.delta_base is not None:
            self.base.version = info.version
        elif _world().rank_in_group == 0:
            self.base.set(info.version, self.fresh)
        self.fresh = {}

    def _receive_and_load(self, t0: float) -> None:
        """Streaming: one thread per sender receives and checks buckets into a short queue (two per sender); this
        thread loads them as they come. Anything that fails once loading has begun poisons the server."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        ready, lock, done = queue.Queue(maxsize=2 * len(self.groups)), threading.Lock(), object()

        def take(group):
            try:
                for bucket in receive_buckets(group):
                    with lock:
                        self.check.add(bucket)
                    ready.put(bucket)
                ready.put(done)
            except BaseException as exc:  # noqa: BLE001  (handed to the loading thread)
                ready.put(exc)

        def arriving():
            finished = 0
            while finished < len(self.groups):
                item = ready.get()
                if item is done:
                    finished += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield from self._kept(item)

        threads = [threading.Thread(target=take, args=(g,), daemon=True) for g in self.groups]
        for t in threads:
            t.start()
        try:
            reload_weights(
                self.vllm_config, self.model, weights_path=None, is_checkpoint_format=True, weights_iterator=arriving()
            )
            repack_cpu_experts(self.model)
        except Exception as exc:  # noqa: BLE001
            self.shutdown()
            self._loaded(False)
            raise RuntimeError(
                f"{POISONED}, the engine holds a mix of versions (streamed update): {type(exc).__name__}: {exc}"
            ) from None
        self.streamed = True
        self.receipt = {"receive_s": time.perf_counter() - t0, "reload_s": time.perf_counter() - t0, "streamed": True}

    def _probe(self, nbytes: int, bucket: int) -> None:
        """The limit a benchmark compares against: sender 0's plain broadcasts into one preallocated buffer, no
        manifest, no check, no load (`CollectiveTransport.probe` is the other side)."""
        group, self.probing = self.groups[0], True
        buf = torch.empty(bucket, dtype=torch.uint8, device=group.device)
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            group.broadcast(buf[: min(left, bucket)]).wait()
            left -= bucket
        self.receipt = {"probe_s": time.perf_counter() - t0, "bytes": nbytes}

    def finish_weight_update(self) -> None:
        if self.error is None:
            try:
                self._finish()
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)

    def _finish(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        if self.probing:
            return
        try:
            self.receipt.update(self.check.finish())
        except BucketError as exc:
            self.buckets = []
            raise RuntimeError(f"{POISONED if self.streamed else REJECTED}: {exc}") from None
        if self.streamed:
            self._loaded(True)
            return
        t0, delta = time.perf_counter(), self.info.delta_base is not None
        if delta:  # decoded (and every digest checked) before anything loads
            try:
                self._decode_all()
            except NeedFull as exc:
                self.buckets = []
                raise RuntimeError(f"{REJECTED}: {NEED_FULL}: {exc}") from None
        self.receipt["delta_apply_s"] = time.perf_counter() - t0 if delta else 0.0
        weights = self._decoded() if delta else (item for b in self.buckets for item in self._kept(b))
        t0 = time.perf_counter()
        try:
            reload_weights(
                self.vllm_config, self.model, weights_path=None, is_checkpoint_format=True, weights_iterator=weights
            )
            repack_cpu_experts(self.model)
        except Exception as exc:  # noqa: BLE001
            self._loaded(False)
            raise RuntimeError(f"{POISONED}, the engine holds a mix of versions: {type(exc).__name__}: {exc}") from None
        finally:
            self.buckets, weights = [], None
        self._loaded(True)
        self.receipt["reload_s"] = time.perf_counter() - t0

    def shutdown(self) -> None:
        for group in self.groups:
            group.close()
        self.groups = []


def _world():
    """vLLM's world group of this server's workers (`rank_in_group`, `world_size`, `device`, `broadcast`)."""
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group()


def _worker_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def register() -> None:
    """Add this backend to vLLM's factory (once per process; the worker extension calls it at import)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, CollectiveReceiver)
