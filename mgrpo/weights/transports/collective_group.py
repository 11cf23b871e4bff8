"""The collective data plane that a trainer's senders and a rollout server's workers share (no vLLM imported here).

One process group per (server, sender), outside every default group: the server opens a TCPStore when a trainer
asks (a guarded route; nothing listens before), and each group's keys live under a one-time nonce, so a peer
without the nonce never finds the group (it times out, refused). Rank 0 of each group is the sender; ranks 1..W
are the server's workers (each receives every bucket and loads its own shard).

The wire, per bucket: a header int64 [BUCKET, manifest bytes, payload bytes], the manifest (JSON as uint8) and the
flat payload (uint8, tensors at aligned offsets: `mgrpo.weights.bucket`); a header [END, 0, 0] ends the
sender's stream. Over gloo on CPU, over NCCL on GPU (the tensors then live on the device).
"""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist

from mgrpo.weights.bucket import Bucket

BUCKET, END = 1, 0


def wire_versions(backend: str) -> dict:
    """What both ends of a group must share: torch (its TCPStore and process-group wire format) and, over NCCL, the
    NCCL library itself (peers of different NCCL versions can hang inside a collective rather than fail)."""
    out = {"torch": torch.__version__.split("+")[0]}
    if backend == "nccl":
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return out


def version_mismatch(trainer: dict, server: dict, backend: str) -> str | None:
    """One line naming both sides' versions when they cannot share a group: torch major.minor differs, or over
    NCCL the NCCL version (exactly); None when they match."""
    t, s = trainer or {}, server or {}
    minor = lambda v: ".".join(str(v or "?").split(".")[:2])  # noqa: E731
    problems = []
    if minor(t.get("torch")) != minor(s.get("torch")):
        problems.append(f"torch {t.get('torch')} (trainer) vs {s.get('torch')} (server)")
    if backend == "nccl" and (not t.get("nccl") or t.get("nccl") != s.get("nccl")):
        problems.append(f"NCCL {t.get('nccl')} (trainer) vs {s.get('nccl')} (server)")
    if not problems:
        return None
    return (
        f"the collective weight channel ({backend}) needs the same versions on both ends: {'; '.join(problems)}; "
        f"install the same torch build on the trainer and the rollout servers"
    )


class Group:
    """One (server, sender) process group and the store connection that formed it."""

    def __init__(self, store, pg, backend: str, device: torch.device):
        self.store, self.pg, self.backend, self.device = store, pg, backend, device

    def broadcast(self, tensor: torch.Tensor):
        return self.pg.broadcast(tensor, 0)

    def close(self) -> None:
        """Drop the connections; an NCCL communicator is aborted first (a broken one may refuse: gone anyway)."""
        if self.backend == "nccl" and self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # noqa: BLE001
                pass
        self.pg = self.store = None


def join_group(
    host: str,
    port: int,
    nonce: str,
    sender: int,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    bind: str = "",
    op_timeout_s: float | None = None,
) -> Group:
    """Join the group of `sender` on the store at host:port under `nonce` as `rank` of `size`; blocks until every
    member has joined (or raises after timeout_s). Each later transfer fails after op_timeout_s (default the
    same). `bind`: the address this process's data connections use."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    scoped = dist.PrefixStore(f"mgrpo/{nonce}/sender{sender}/", store)
    timeout = datetime.timedelta(seconds=op_timeout_s or timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind or host)]
        return Group(store, dist.ProcessGroupGloo(scoped, rank, size, opts), backend, torch.device("cpu"))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        pg = dist.ProcessGroupNCCL(scoped, rank, size, opts)
        return Group(store, pg, backend, device)
    raise ValueError(f"collective backend {backend!r}: use gloo (CPU) or nccl (GPU)")


def send_bucket(groups: list, bucket: Bucket) -> list:
    """Start broadcasting one bucket into every group; returns [(group, works)] to wait on (the caller packs the
    next bucket meanwhile). The tensors must stay alive until the works finish."""
    raw = json.dumps(bucket.manifest).encode()
    return [(g, _start(g, BUCKET, raw, bucket.flat)) for g in groups]


def send_end(groups: list) -> list:
    return [(g, _start(g, END, b"", None)) for g in groups]


def _start(group: Group, kind: int, raw: bytes, flat) -> list:
    dev = group.device
    head = torch.tensor([kind, len(raw), 0 if flat is None else flat.numel()], dtype=torch.long, device=dev)
    works = [group.broadcast(head)]
    if kind == BUCKET:
        works.append(group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)))
        if flat.numel():
            works.append(group.broadcast(flat if flat.device == dev else flat.to(dev)))
    return works


def receive_buckets(group: Group):
    """Buckets from the group's sender, in order, until its END (raises if the group breaks or times out)."""
    dev = group.device
    while True:
        head = torch.zeros(3, dtype=torch.long, device=dev)
        group.broadcast(head).wait()
        kind, n_raw, n_flat = (int(x) for x in head.tolist())
        if kind == END:
            return
        raw = torch.empty(n_raw, dtype=torch.uint8, device=dev)
        group.broadcast(raw).wait()
        flat = torch.empty(n_flat, dtype=torch.uint8, device=dev)
        if n_flat:
            group.broadcast(flat).wait()
        yield Bucket(flat, json.loads(raw.cpu().numpy().tobytes().decode()))
