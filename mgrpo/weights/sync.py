"""`WeightSync`: the one interface between the trainer and every weight transport.

Each trainer rank holds one `WeightSync` and calls `push(export, version)` once per weight version; the trainer
never asks which transport it holds. Two families implement it:

- `StreamSync`: transports fed by the exported `(HF name, tensor)` stream (`send(named_tensors, version)`): the
  in-process HF engine, shared memory / CUDA IPC to a colocated engine, HTTP buckets to remote servers, and LoRA
  adapter folders. The export is a collective every rank drives; ranks that own no engine hold `NoEngine`, which
  drives it and sends nothing. After a failed send the rest of the stream is still driven, so no rank is left
  blocked in the export.
- `PerStageSync`: each pipeline stage sends its own weights straight from the model chunks
  (`send_model(model_chunks, version)`): collective broadcast to vLLM or SGLang servers; no stream is exported.

Peers make the same split, one sender class per transport behind one call: verl's `CheckpointEngine`
(volcengine/verl, verl/checkpoint_engine/base.py) and slime's `UpdateWeightFromTensor` / `UpdateWeightFromDistributed`
(THUDM/slime, slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py and
update_weight_from_distributed.py).
"""

from __future__ import annotations

from typing import Iterable, Iterator


class WeightSyncError(RuntimeError):
    """An engine rejected or failed a weight update; the message says whether the old version still serves."""


def held_in_flight(receipts: dict) -> dict:
    """What a partial push (rollout.partial) did to generation on the servers: the requests it held and continued
    on the new weights, and the longest pause; {} when no server held any (their requests finished first)."""
    if not any("held_requests" in r for r in receipts.values()):
        return {}
    return {
        "held_requests": sum(r.get("held_requests", 0) for r in receipts.values()),
        "generation_paused_s": max(r.get("total_s", 0.0) for r in receipts.values()),
    }


class Export:
    """One weight version as this rank's share of the export: `tensors()` streams (HF name, tensor) on the ranks
    `owners` names (a collective: every rank must drive it, or none), `model_chunks` for per-stage senders.
    `adapter_only`: LoRA factors under PEFT names instead of merged weights."""

    def __init__(self, model_chunks: list, owners, bucket_bytes: int, adapter_only: bool = False):
        self.model_chunks, self.owners = model_chunks, owners
        self.bucket_bytes, self.adapter_only = bucket_bytes, adapter_only
        self.bytes: int | None = None  # HF tensor bytes streamed to this rank (None: nothing was streamed)
        self._stream: Iterator | None = None

    def tensors(self) -> Iterator[tuple]:
        if self._stream is None:
            self._stream = self._counted()
        return self._stream

    def drain(self) -> None:
        """Drive the rest of the export (all of it if nothing was read yet)."""
        for _ in self.tensors():
            pass

    def _counted(self) -> Iterator[tuple]:
        from mgrpo.models.lora import peft_tensors
        from mgrpo.weights.export import export_hf, full_hf_tensors

        self.bytes = 0
        tensors = peft_tensors if self.adapter_only else full_hf_tensors
        for name, t in export_hf(self.model_chunks, dst=self.owners, bucket_bytes=self.bucket_bytes, tensors=tensors):
            self.bytes += t.numel() * t.element_size()
            yield name, t


class WeightSync:
    """One weight transport, seen from one trainer rank."""

    checksum = False  # whether buckets carry a digest (they do whenever they leave the process)

    def push(self, export: Export, version: int) -> dict | None:
        """Send weight version `version`; returns the engine's receipt (None where this rank sends nothing)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free buffers, groups and folders; the engine is closed by its owner."""


class StreamSync(WeightSync):
    """A transport fed by the exported stream."""

    def push(self, export: Export, version: int) -> dict | None:
        try:
            return self.send(export.tensors(), version)
        finally:
            export.drain()  # a failed send still drives the rest of the collective export

    def send(self, named_tensors: Iterable[tuple], version: int) -> dict | None:
        raise NotImplementedError


class PerStageSync(WeightSync):
    """A transport where every pipeline stage sends its own weights from the model chunks."""

    def push(self, export: Export, version: int) -> dict | None:
        return self.send_model(export.model_chunks, version)

    def send_model(self, model_chunks: list, version: int) -> dict | None:
        raise NotImplementedError

    @staticmethod
    def sender_totals(reports: list) -> dict:
        """A receipt's sender side from every stage sender's report: bytes and buckets summed, times the slowest
        sender's (they send at the same time)."""
        return dict(
            senders=len(reports),
            bytes=sum(rep.get("bytes", 0) for rep in reports),
            buckets=sum(rep.get("buckets", 0) for rep in reports),
            export_s=max((rep.get("export_s", 0.0) for rep in reports), default=0.0),
            transfer_s=max((rep.get("transfer_s", 0.0) for rep in reports), default=0.0),
        )


class NoEngine(StreamSync):
    """A rank that owns no engine: it drives its share of the export and sends nothing."""

    def send(self, named_tensors: Iterable[tuple], version: int) -> None:
        return None
