"""`InProcessTransport`: the HF engine lives in the trainer rank that receives the export."""

from __future__ import annotations

from typing import Iterable

from mgrpo.weights.bucket import view_buckets
from mgrpo.weights.sync import StreamSync


class InProcessTransport(StreamSync):
    """Buckets are views of the exported tensors (no packing copy); the engine checks the manifest against its
    own parameters, then copies each tensor once into place (all or nothing)."""

    checksum = False  # nothing leaves the process

    def __init__(self, engine, bucket_bytes: int):
        self.engine, self.bucket_bytes = engine, bucket_bytes

    def send(self, named_tensors: Iterable[tuple], version: int) -> dict:
        """Push one weight version; returns the engine's receipt (tensors, bytes, buckets, version)."""
        return self.engine.update_weights(view_buckets(named_tensors, self.bucket_bytes, version), version)
