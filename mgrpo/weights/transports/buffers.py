"""Buffers a trainer writes and a colocated engine's worker reads in place: POSIX shared memory on CPU, a
CUDA-IPC buffer on GPU. Both describe themselves as JSON (a path, or an IPC handle in base64), so the engine
side opens them from a JSON message; nothing is pickled.

Only this module knows the two kinds; `SharedMemoryTransport` and the vLLM worker see `.view` (a uint8 tensor)
and `.describe()`.
"""

from __future__ import annotations

import base64
import mmap
import os

import torch

SHM_DIR = "/dev/shm"


def buffer_prefix(trainer_pid: int, token: str) -> str:
    """Names of one engine's buffers: its engine process removes them if the trainer dies without closing."""
    return f"mgrpo-{trainer_pid}-{token[:8]}"


class NoFence:
    """CPU copies are complete when `copy_` returns."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaFence:
    """An event per ring slot: recorded after the copies into the slot on the current stream, waited on before the
    slot is described to a reader (or handed back to the writer). GPU only; not run on CPU."""

    def __init__(self):
        self.event = torch.cuda.Event()

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream())

    def wait(self) -> None:
        self.event.synchronize()


class PosixShmBuffer:
    """A file under /dev/shm (0600, O_EXCL), mapped read-write by both sides. Unlinked by its creator."""

    kind = "posix"

    def __init__(self, name: str, nbytes: int, create: bool = True):
        self.path, self.nbytes, self.owner = os.path.join(SHM_DIR, name), int(nbytes), create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.nbytes)
            self._mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self._mm, dtype=torch.uint8)

    def describe(self) -> dict:
        return {"kind": self.kind, "path": self.path, "nbytes": self.nbytes}

    def fence(self) -> NoFence:
        return NoFence()

    @classmethod
    def open(cls, desc: dict) -> "PosixShmBuffer":
        path = desc["path"]
        if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith("mgrpo-"):
            raise ValueError(f"refusing to map {path!r}: not an mgrpo buffer under {SHM_DIR}")
        return cls(os.path.basename(path), desc["nbytes"], create=False)

    def close(self) -> None:
        self.view = None
        try:
            self._mm.close()
        except BufferError:  # a tensor view is still alive somewhere; the mapping goes when it does
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class CudaIpcBuffer:
    """A CUDA allocation shared by IPC handle with a process on the same GPU (verl's colocated buffer).
    GPU only: written against torch's `UntypedStorage._share_cuda_` / `_new_shared_cuda`; not run on CPU."""

    kind = "cuda_ipc"

    def __init__(self, name: str, nbytes: int, create: bool = True, view: torch.Tensor | None = None):
        self.name, self.nbytes = name, int(nbytes)
        self.view = view if view is not None else torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        self._described = None

    def describe(self) -> dict:
        """The IPC handle, made once per buffer (each `_share_cuda_` call exports the allocation again)."""
        if self._described is None:
            fields = self.view.untyped_storage()._share_cuda_()
            self._described = {
                "kind": self.kind,
                "nbytes": self.nbytes,
                "device": torch.cuda.current_device(),
                "handle": [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in fields],
            }
        return self._described

    def fence(self) -> CudaFence:
        return CudaFence()

    @classmethod
    def open(cls, desc: dict) -> "CudaIpcBuffer":
        fields = [base64.b64decode(f) if isinstance(f, str) else f for f in desc["handle"]]
        fields[0] = torch.cuda.current_device()  # the receiving process's index of the same GPU
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        view = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage, 0, (desc["nbytes"],))
        return cls("ipc", desc["nbytes"], create=False, view=view)

    def close(self) -> None:
        self.view = None


BUFFER_KINDS = {PosixShmBuffer.kind: PosixShmBuffer, CudaIpcBuffer.kind: CudaIpcBuffer}


def open_buffer(desc: dict):
    if desc.get("kind") not in BUFFER_KINDS:
        raise ValueError(f"unknown buffer kind {desc.get('kind')!r}; known: {', '.join(BUFFER_KINDS)}")
    return BUFFER_KINDS[desc["kind"]].open(desc)
