"""HTTP bucket transport to remote rollout servers, both ends of its wire. Body of `PUT /mgrpo/weights/V/I`: one
bucket in the format `mgrpo.weights.bucket` defines (safetensors header, aligned payload), streamed straight
from the exported tensors in one pass that hashes each chunk as it goes, then the 64-hex-digit digest (over
payload and manifest, `mgrpo.weights.bucket.Digest`) as a trailer, so no bucket is ever built in memory nor
read twice. The server (`StreamCheck`) hashes as it receives, checks the trailer, and returns the digest; the
client compares. A version is applied only by the commit after the last bucket (the server pauses, loads
everything, checks completeness, resets its prefix cache, resumes).

A failed commit is never retried blindly: the client asks the server which version it holds and what it has
staged, then resends only what is missing (the commit itself, when every bucket is staged).

With `delta` (`rollout.remote.delta`), a replica that holds the sender's last version gets each tensor as what
changed (`mgrpo.weights.delta`); one that does not (restarted, excluded, or answering "need full" at its commit)
gets the whole version from the sender's base in the same push.
"""

from __future__ import annotations

import hmac
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from mgrpo.weights.bucket import (
    DIGEST_HEX,
    BucketError,
    Digest,
    bucket_header,
    cut_buckets,
    parse_bucket_header,
)
from mgrpo.weights.sync import StreamSync, WeightSyncError, held_in_flight


class NeedFullError(WeightSyncError):
    """The server cannot apply this delta exactly (another base, a digest mismatch): send the whole version."""


TRAILER = DIGEST_HEX["sha256"]  # the body ends with the hex digest of payload and manifest (64 digits for sha256)
DIGEST_HEADER = "x-mgrpo-digest"  # which digest the trailer holds: sha256 (the default) or xxh3_128


def bucket_body(items: list, header: bytes, total: int, manifest: dict, out: dict, algo: str = "sha256"):
    """The request body, streamed: the safetensors header (`bucket_header`), the payload (views of the tensors,
    hashed as they go), then the hex digest (`algo`) as a trailer; `out["digest"]` holds it once the body is
    through."""
    h = Digest(total, algo)
    yield header
    for chunk in _payload(items, manifest["offsets"], manifest["nbytes"], total):
        h.update(chunk)
        yield chunk
    out["digest"] = h.finish(manifest)
    yield out["digest"].encode()


class StreamCheck:
    """The receiving end of `bucket_body` (the rollout server): the digest computed as the chunks arrive (no
    second pass over the staged file). The safetensors header is parsed by hand (JSON only) from the first
    bytes, the payload is hashed as it streams, and the last TRAILER bytes are the sender's hex digest, compared
    at the end."""

    def __init__(self, size: int, algo: str = "sha256"):
        if algo not in DIGEST_HEX:
            raise BucketError(f"unknown digest {algo!r} ({DIGEST_HEADER}); use one of {', '.join(DIGEST_HEX)}")
        self.algo, self.trailer_size = algo, DIGEST_HEX[algo]
        self.file_size = size - self.trailer_size
        self.head, self.trailer, self.pos, self.hash, self.manifest = b"", b"", 0, None, None

    def feed(self, chunk: bytes) -> bytes:
        """Take the next chunk; return the part of it that belongs in the staged file."""
        keep = chunk[: max(0, self.file_size - self.pos)]
        self.trailer += chunk[len(keep) :]
        if self.hash is None:
            self.head += keep
            if len(self.head) >= 8 and len(self.head) >= 8 + int.from_bytes(self.head[:8], "little"):
                n, self.manifest, start, end = parse_bucket_header(self.head)
                if 8 + n + end != self.file_size:
                    raise BucketError(
                        f"the safetensors header says {8 + n + end} bytes, the body carries "
                        f"{self.file_size} before its {self.algo} trailer"
                    )
                self.hash = Digest(end - start, self.algo)
                self.hash.update(memoryview(self.head)[8 + n :])
                self.head = b""
        else:
            self.hash.update(keep)
        self.pos += len(keep)
        return keep

    def finish(self) -> str:
        """The digest checked against the trailer; raises BucketError naming what is wrong."""
        if self.hash is None or len(self.trailer) != self.trailer_size:
            raise BucketError(f"the body ends before its safetensors header and {self.algo} trailer are complete")
        got, sent = self.hash.finish(self.manifest), self.trailer.decode("ascii", "replace")
        if not hmac.compare_digest(got, sent):
            raise BucketError(
                f"{self.algo} mismatch (the trailer says {sent[:12]}..., the bytes that arrived hash to "
                f"{got[:12]}...); the bucket was altered or cut in transit, resend it"
            )
        return got


def _payload(items: list, offsets: list, nbytes: list, total: int):
    """The flat payload as memoryviews of the tensors themselves (zero padding between), no copy."""
    pos = 0
    for (_, t), off, n in zip(items, offsets, nbytes):
        if off > pos:
            yield bytes(off - pos)
        t = t.detach()
        if not t.is_contiguous() or t.device.type != "cpu":
            t = t.contiguous().cpu()
        yield memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else b""
        pos = off + n
    if total > pos:
        yield bytes(total - pos)


class HttpBucketTransport(StreamSync):
    checksum = True  # buckets leave the machine

    def __init__(
        self,
        engine,
        bucket_bytes: int,
        update_timeout_s: float = 600.0,
        algo: str = "xxh3_128",
        delta: bool = False,
        full_every: int = 0,
    ):
        if algo not in DIGEST_HEX:
            raise ValueError(f"rollout.remote.checksum={algo!r}; use one of {', '.join(DIGEST_HEX)}")
        self.engine, self.bucket_bytes, self.timeout, self.algo = engine, bucket_bytes, update_timeout_s, algo
        self.conns: dict = {}
        self.full_every = full_every
        self.delta = None
        if delta:
            from mgrpo.weights.delta import DeltaSender

            self.delta = DeltaSender()

    def _conn(self, replica) -> http.client.HTTPConnection:
        if replica.name not in self.conns:
            u = urlsplit(replica.url)
            if u.scheme == "https":
                conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=self.timeout, context=self.engine.ssl)
            else:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout)
            self.conns[replica.name] = conn
        return self.conns[replica.name]

    def _request(self, replica, method: str, path: str, parts=None, length: int = 0, body: dict | None = None) -> dict:
        """One request on the replica's kept-alive connection; `parts()` yields the streamed body. A kept
        connection the server has meanwhile closed is reopened once (PUT of a bucket and the commit's state
        check are idempotent; a commit is never resent here)."""
        reused = replica.name in self.conns
        try:
            return self._send(replica, method, path, parts, length, body)
        except ConnectionError:
            if not reused or path.endswith("/commit"):
                raise
            return self._send(replica, method, path, parts, length, body)

    def _send(self, replica, method, path, parts, length, body) -> dict:
        conn = self._conn(replica)
        try:
            conn.putrequest(method, path)
            for key, value in self.engine.update_headers().items():  # the token, this run and process
                conn.putheader(key, value)
            data = json.dumps(body).encode() if body is not None else None
            conn.putheader("Content-Type", "application/json" if data is not None else "application/octet-stream")
            if parts:
                conn.putheader(DIGEST_HEADER, self.algo)
            conn.putheader("Content-Length", str(len(data) if data is not None else length))
            conn.endheaders()
            if data is not None:
                conn.send(data)
            for chunk in parts() if parts else ():
                conn.send(chunk)
            resp = conn.getresponse()
            text = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            self.conns.pop(replica.name, None)
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        try:
            out = json.loads(text)
        except ValueError:
            out = {"error": text[:200].decode(errors="replace")}
        if resp.status != 200:
            raise (NeedFullError if out.get("need_full") else WeightSyncError)(
                f"rollout server {replica.name}: {method} {path} -> {resp.status}: {out.get('error', out)}"
            )
        return out

    def send(self, named_tensors, version: int) -> dict:
        """Push one weight version to every replica that is up (or answers again); returns a receipt with the
        time split into export, transfer, load and cache reset (and, with deltas, what they saved)."""
        targets = self.engine.rejoin_candidates()
        if not targets:
            raise WeightSyncError(str(self.engine.no_replica_left()))
        d = self.delta
        base = d.version if d is not None else None
        if base is not None and self.full_every and version % self.full_every == 0:
            base = None  # sync.full_every: a full push now and then
        gets_delta = {r.name for r in targets if base is not None and r.version == base}
        if d is not None:
            d.reset_stats()
        try:
            receipts, timing, buckets, sent_bytes = self._push(named_tensors, version, targets, gets_delta)
        except BaseException:
            if d is not None:
                d.forget()  # its base may hold part of this version: the next push is full
            raise
        if d is not None:
            if receipts:
                d.commit(version)
            else:
                d.forget()
        if not receipts:
            raise WeightSyncError(
                f"weight version {version} reached no rollout server: {str(self.engine.no_replica_left())}"
            )
        self.engine.version = version
        first = next(iter(receipts.values()))
        out = dict(
            version=version,
            buckets=buckets,
            bytes=sent_bytes,
            servers=sorted(receipts),
            **timing,
            load_s=max(r.get("load_s", 0.0) for r in receipts.values()),
            reset_s=max(r.get("reset_s", 0.0) for r in receipts.values()),
            tensors=first.get("tensors"),
            **held_in_flight(receipts),
        )
        if d is not None:
            out["delta"] = dict(
                d.stats,
                apply_s=max(r.get("delta_apply_s", 0.0) for r in receipts.values()),
                base=base,
                servers=sorted(gets_delta & set(receipts)),
                full_fallback=sorted(n for n, r in receipts.items() if r.get("full_fallback")),
                base_host_bytes=d.host_bytes,
            )
        return out

    def _push(self, named_tensors, version: int, targets: list, gets_delta: set) -> tuple:
        """Stream the buckets to `targets` (the delta to those in `gets_delta`), then commit on all at once; a
        replica that answers "need full" gets the whole version from the sender's base before this returns."""
        d = self.delta
        digests = {r.name: [] for r in targets}
        timing, sent_bytes, t = dict(export_s=0.0, transfer_s=0.0), {r.name: 0 for r in targets}, time.perf_counter()
        index = -1
        for index, pending in enumerate(cut_buckets(named_tensors, self.bucket_bytes)):
            full_body, delta_body = (pending, None), None
            if d is not None:
                wire, section = d.encode(pending, delta=bool(gets_delta))
                if section is not None:
                    delta_body = (wire, {"delta": section})
            timing["export_s"] += time.perf_counter() - t
            t = time.perf_counter()
            for replica in list(targets):
                items, extra = delta_body if delta_body and replica.name in gets_delta else full_body
                try:
                    sent_bytes[replica.name] += self._put(replica, version, index, items, extra, digests[replica.name])
                except (ConnectionError, WeightSyncError) as exc:
                    self.engine.mark_down(replica, f"weight version {version}, bucket {index}: {exc}")
                    targets.remove(replica)
            timing["transfer_s"] += time.perf_counter() - t
            t = time.perf_counter()
        timing["export_s"] += time.perf_counter() - t
        receipts = {}

        def commit_one(replica):  # every replica pauses, loads and resumes at the same time
            try:
                return replica, self._commit(replica, version, digests[replica.name]), None
            except NeedFullError as exc:
                if d is None:
                    return replica, None, exc
                try:  # the same step: the whole version, from the sender's base
                    log = []
                    for i, items in enumerate(cut_buckets(d.items(), self.bucket_bytes)):
                        self._put(replica, version, i, items, None, log)
                    return replica, dict(self._commit(replica, version, log), full_fallback=str(exc)), None
                except (ConnectionError, WeightSyncError) as again:
                    return replica, None, again
            except (ConnectionError, WeightSyncError) as exc:
                return replica, None, exc

        with ThreadPoolExecutor(max_workers=max(len(targets), 1)) as pool:
            for replica, receipt, exc in pool.map(commit_one, list(targets)):
                if exc is None:
                    receipts[replica.name], replica.version = receipt, version
                else:
                    self.engine.mark_down(replica, f"weight version {version} not applied: {exc}")
        return receipts, timing, index + 1, max(sent_bytes.values(), default=0)  # bytes: to the replica sent most

    def _put(self, replica, version: int, index: int, items: list, extra, digests: list) -> int:
        """PUT one bucket to one replica and record its digest in `digests[index]`; returns the bytes sent."""
        header, total, manifest = bucket_header(items, version, index, extra)
        sent = {}
        got = self._request(
            replica,
            "PUT",
            f"/mgrpo/weights/{version}/{index}",
            lambda: bucket_body(items, header, total, manifest, sent, self.algo),
            len(header) + total + DIGEST_HEX[self.algo],
        )
        if got.get("digest") != sent.get("digest"):
            raise WeightSyncError(
                f"rollout server {replica.name} checked {self.algo} {str(got.get('digest'))[:12]}..., sent "
                f"{str(sent.get('digest'))[:12]}..."
            )
        digests.extend([None] * (index + 1 - len(digests)))
        digests[index] = sent.get("digest")
        return total

    def _commit(self, replica, version: int, digests: list) -> dict:
        body = {"count": len(digests), "digests": digests, "keep_base": self.delta is not None}
        body["in_flight"] = getattr(self.engine, "in_flight", "finish")  # rollout.partial: held, not finished
        try:
            return self._request(replica, "POST", f"/mgrpo/weights/{version}/commit", body=body)
        except ConnectionError as first:  # did it apply? ask before resending anything
            try:
                state = self.engine.get(replica, "/mgrpo/version", timeout=30)
                deadline = time.monotonic() + self.timeout
                while state.get("updating") == version and time.monotonic() < deadline:  # never resend a running one
                    time.sleep(0.5)
                    state = self.engine.get(replica, "/mgrpo/version", timeout=30)
            except Exception:  # noqa: BLE001
                raise ConnectionError(f"commit failed ({first}) and the server does not answer") from None
            if state.get("poisoned"):
                raise ConnectionError(f"commit failed ({first}); the server is poisoned: {state['poisoned']}")
            if state.get("version") == version:
                return {"version": version, "recovered": True}
            if state.get("staged_version") == version and state.get("staged") == list(range(len(digests))):
                return self._request(replica, "POST", f"/mgrpo/weights/{version}/commit", body=body)
            raise ConnectionError(
                f"commit failed ({first}); the server holds version {state.get('version')} "
                f"and has staged {len(state.get('staged') or [])}/{len(digests)} buckets"
            ) from None

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
