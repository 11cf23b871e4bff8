"""What every weight transport shares: its interface and the error an engine's rejected update raises."""

from __future__ import annotations

from typing import Iterable, Protocol


class WeightSyncError(RuntimeError):
    """An engine rejected or failed a weight update; the message says whether the old version still serves."""


class Transport(Protocol):
    checksum: bool  # whether buckets carry a digest (they do whenever they leave the process)

    def send(self, named_tensors: Iterable[tuple], version: int) -> dict:
        """Push one weight version (a stream of (HF name, tensor)); returns the engine's receipt."""
