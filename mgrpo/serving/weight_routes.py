"""The rollout server's weight routes (all behind the token guard), and the state that keeps updates whole.

    PUT  /mgrpo/weights/{version}/{index}   one bucket (`transports/http_buckets.py`: body + digest trailer),
                                            written to a temporary file, checked as it streams, renamed in place
    POST /mgrpo/weights/{version}/commit    {"count", "digests": [...], "in_flight"}: pause generation (requests in
                                            flight finish, or are held: `apply_version`), load every staged bucket
                                            through the worker (complete, nothing unknown, shapes, dtypes), reset
                                            the prefix cache, stamp the version, resume
    POST /mgrpo/interrupt                   {"expect"}: end every request in flight with its tokens so far (a
                                            checkpoint of a partial run continues them from their prefixes)
    GET  /mgrpo/version                     version, poisoned, updating, staged, owner: what a client asks first
    GET  /mgrpo/stats, /mgrpo/routes        requests served and in flight; every route of the app (for audits)

One lock covers staging and commit. A PUT for the version being committed answers 409 at once (it never waits to
rewrite a file the worker has mapped), and so does a commit while another runs. Pause and load have a deadline
(`--update-timeout-s`): past it, or when a load fails half-way, or when vLLM keeps blocks and refuses to reset its
prefix cache, the server is poisoned: generation and GET /health answer 503 with the reason, PUT and commit 409,
until it is restarted. Every PUT and commit names its trainer run and process; `ownership.py` refuses another
trainer (409, unless it takes over) and any version not newer than the run's last (no rollback).
"""
# (no `from __future__ import annotations`: FastAPI reads the route signatures at runtime)

import asyncio
import json
import os
import sys
import time

from mgrpo.serving.ownership import ATTEMPT_HEADER, RUN_HEADER, TAKE_OVER_HEADER, Ownership
from mgrpo.serving.vllm_settings import until, until_held

MAX_COMMIT_BODY = 1 << 20  # the commit's JSON: a digest per bucket


class UpdateState:
    def __init__(self):
        self.lock = asyncio.Lock()
        self.poisoned = None  # why the engine may hold a mix of versions; then nothing is served
        self.committing = None  # the version being applied, or None
        self.owner = Ownership(log=lambda msg: print(f"mgrpo-server: {msg}", file=sys.stderr, flush=True))
        self.on_new_owner = []  # what belongs to the previous owner and must go: staged buckets, open groups
        self.interrupts = 0  # POST /mgrpo/interrupt calls begun: a response aborted under one is "interrupted"

    def refusal(self, version: int | None) -> str | None:
        if self.poisoned:
            return f"the server is poisoned and loads nothing more: {self.poisoned}; restart it"
        if version is not None and self.committing == version:
            return f"version {version} is being committed; a bucket of it cannot change now"
        return None

    def claim(self, version: int | None, headers) -> str | None:
        """Why this sender may not update to `version` (another trainer, an old version), else None; under the
        lock. A new owner drops what the previous one left."""
        before = (self.owner.run, self.owner.attempt)
        why = self.owner.refusal(
            headers.get(RUN_HEADER, ""),
            headers.get(ATTEMPT_HEADER, ""),
            version,
            headers.get(TAKE_OVER_HEADER, "") == "1",
        )
        if not why and (self.owner.run, self.owner.attempt) != before:
            for drop in self.on_new_owner:
                drop()
        return why


class UpdateFailed(Exception):
    """A load that failed: `poisoned` when the engine may hold a mix of versions, else the old weights serve."""

    def __init__(self, message: str, poisoned: bool = False):
        super().__init__(message)
        self.poisoned = poisoned


IN_FLIGHT = ("finish", "keep", "recompute")


def in_flight_of(body: dict) -> tuple:
    """(the commit body's `in_flight` mode, or why it is refused: for a 400)."""
    mode = body.get("in_flight", "finish")
    return (mode, None) if mode in IN_FLIGHT else (None, f"in_flight={mode!r}: one of {', '.join(IN_FLIGHT)}")


async def apply_version(
    gate, update: UpdateState, engine_client, version: int, timeout_s: float, load, in_flight: str = "finish"
):
    """`update.committing` names `version` while it applies (a PUT of it is refused, GET /mgrpo/version shows it)."""
    update.committing = version
    try:
        return await _apply_version(gate, update, engine_client, version, timeout_s, load, in_flight)
    finally:
        update.committing = None


async def _apply_version(gate, update: UpdateState, engine_client, version: int, timeout_s: float, load, in_flight):
    """Pause generation, `await load(seconds left)` -> receipt, reset the prefix cache, stamp the version (the
    header, and vLLM's engine-core label every token carries), resume; all within `timeout_s`. Past the deadline,
    after a half-done load, or when vLLM keeps blocks and refuses to reset its prefix cache, the server is
    poisoned. Returns the receipt with the time split, or an error response.

    `in_flight` (rollout.partial, issue 56; the colocated engine's `VLLMServer.update` does the same): "finish"
    lets the requests in flight finish on the old weights first; "keep" freezes them inside vLLM
    (`pause_generation(mode="keep", clear_cache=False)`) and continues them on the new weights over the KV their
    prefix got under the old ones; "recompute" preempts them and drops every cached block, so their prefixes are
    prefilled again under the new weights. Held requests keep blocks, so the prefix cache is not reset: requests
    that start later are salted with their version instead (`server.salted`)."""
    from fastapi.responses import JSONResponse

    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    left = lambda: max(deadline - time.perf_counter(), 0.001)  # noqa: E731
    held, requests = in_flight != "finish", gate.inflight
    try:
        await asyncio.wait_for(gate.pause(wait_for_calls=not held), timeout=left())
        if held:
            await asyncio.wait_for(
                engine_client.pause_generation(mode="keep", clear_cache=in_flight == "recompute"), timeout=left()
            )
    except asyncio.TimeoutError:
        update.poisoned = (
            f"requests in flight did not {'pause' if held else 'finish'} within --update-timeout-s={timeout_s:g}"
        )
        await _resume(gate, engine_client, held, update)
        return JSONResponse({"error": update.poisoned}, status_code=503)
    try:
        t1 = time.perf_counter()
        try:
            receipt = await load(left())
        except asyncio.TimeoutError:
            update.poisoned = (
                f"loading version {version} did not finish within --update-timeout-s={timeout_s:g}; "
                f"the engine may hold a mix of versions"
            )
            return JSONResponse({"error": update.poisoned}, status_code=503)
        except UpdateFailed as exc:
            if exc.poisoned:
                update.poisoned = str(exc)
            return JSONResponse({"error": str(exc)}, status_code=503 if exc.poisoned else 422)
        t2 = time.perf_counter()
        if not held and not await engine_client.reset_prefix_cache():  # blocks still held: old KV could be reused
            update.poisoned = f"vLLM refused to reset its prefix cache after loading version {version}"
            return JSONResponse({"error": update.poisoned}, status_code=503)
        await engine_client.engine_core.set_weight_version_async(str(version))
        gate.version = version
    finally:
        await _resume(gate, engine_client, held, update)
    t3 = time.perf_counter()
    times = dict(pause_s=t1 - t0, load_s=t2 - t1, reset_s=t3 - t2, total_s=t3 - t0)
    return dict(receipt, version=version, **times, held_requests=requests if held else 0)


async def _expected_calls(request) -> int:
    """The interrupt's `{"expect": n}`: the generation calls its sender has in flight to this server (0 for an empty
    body); None when the body is something else."""
    body = await request.body()
    try:
        expect = json.loads(body).get("expect", 0) if body else 0
    except (ValueError, AttributeError):
        return None
    return expect if type(expect) is int and 0 <= expect < 1 << 20 else None


async def _resume(gate, engine_client, held: bool, update: UpdateState) -> None:
    """Generation goes on; requests held through a load that did not complete end as aborted (they must not
    sample from a mix of versions)."""
    try:
        if held:
            if update.poisoned:
                await engine_client.pause_generation(mode="abort", clear_cache=False)
            await engine_client.resume_generation()
    finally:
        await gate.resume()


def add_weight_routes(
    app,
    engine_client,
    gate,
    staging,
    update: UpdateState,
    expected: dict,
    optional: list,
    update_timeout_s: float = 600.0,
) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from mgrpo.serving.staging import StagingFull
    from mgrpo.weights.bucket import BucketError
    from mgrpo.weights.transports.http_buckets import DIGEST_HEADER, StreamCheck

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    def refusal(version: int):
        why = update.refusal(version)
        return error(409, why) if why else None

    def not_owner(version: int, request):
        why = update.claim(version, request.headers)
        return error(409, why) if why else None

    update.on_new_owner.append(lambda: staging.reset(None))
    from mgrpo.serving.delta_store import DeltaStore

    store = DeltaStore(staging.dir)  # the last loaded version, kept while the trainer sends deltas
    update.on_new_owner.append(store.forget)

    @app.put("/mgrpo/weights/{version}/{index}")
    async def put_bucket(version: int, index: int, request: Request):
        refused = refusal(version)
        if refused:
            return refused
        size = int(request.headers.get("content-length") or -1)
        if not 0 < size <= staging.max_bytes:
            return error(
                413 if size > 0 else 411,
                f"bucket body of {size} bytes; send Content-Length, at most {staging.max_bytes} (--max-bucket-mb)",
            )
        try:
            check = StreamCheck(size, request.headers.get(DIGEST_HEADER, "sha256"))
        except BucketError as exc:
            return error(400, str(exc))
        async with update.lock:
            refused = refusal(version) or not_owner(version, request)
            if refused:
                return refused
            try:
                staging.admit(version, index, size)
            except StagingFull as exc:
                return error(413, str(exc))
            temp, got = staging.temp_path(version, index), 0
            try:
                with open(temp, "wb") as f:
                    async for chunk in request.stream():
                        got += len(chunk)
                        if got > size:
                            break
                        f.write(check.feed(chunk))
                if got != size:
                    raise ValueError(f"{got} bytes arrived, Content-Length {size}")
                sha = check.finish()
                staging.keep(version, index, temp, sha, size)
            except ValueError as exc:  # BucketError is one; a non-ASCII trailer too
                return error(400, f"bucket {index} of version {version} rejected, nothing staged: {exc}")
            finally:  # the client gone, the disk full, a bad digest: no partial file stays
                if os.path.exists(temp):
                    os.unlink(temp)
        return {"index": index, "version": version, "bytes": size, "digest": sha, "algo": check.algo}

    @app.post("/mgrpo/weights/{version}/commit")
    async def commit(version: int, request: Request):
        refused = refusal(version)
        if refused:
            return refused
        if update.committing is not None:
            return error(409, f"an update to version {update.committing} is in progress; ask GET /mgrpo/version")
        if int(request.headers.get("content-length") or MAX_COMMIT_BODY + 1) > MAX_COMMIT_BODY:
            return error(413, f"the commit body must come with Content-Length, at most {MAX_COMMIT_BODY} bytes")
        body = await request.json()
        count, digests = int(body.get("count", -1)), list(body.get("digests") or [])
        in_flight, bad = in_flight_of(body)
        if bad:
            return error(400, bad)
        async with update.lock:
            refused = not_owner(version, request)
            if refused:
                return refused
            have = {i: sha for i, (_, sha, _) in staging.buckets.items()} if staging.version == version else {}
            if count != len(digests) or have != dict(enumerate(digests)):
                missing = sorted(set(range(len(digests))) - set(have))[:5]
                return error(
                    409,
                    f"version {version} is not completely staged (count {count}, staged "
                    f"{len(have)}, missing or different: {missing}); resend its buckets",
                )
            staged = [staging.buckets[i][0] for i in range(count)]
            if store.version is not None and store.version != gate.version:
                store.forget()  # the weights changed another way (collective, LoRA): no delta applies
            try:
                paths, delta = await asyncio.to_thread(store.prepare, version, staged)
            except (OSError, ValueError) as exc:  # NeedFull and BucketError are ValueErrors
                staging.reset(None)
                return JSONResponse({"error": str(exc), "need_full": True}, status_code=409)
            result = await _apply(version, paths, in_flight)
            if isinstance(result, dict):  # applied (an error is a response)
                update.owner.committed(version)
                if body.get("keep_base"):
                    store.keep(version, paths)
                    result.update(delta_apply_s=store.apply_s if delta else 0.0, base_version=version)
                else:
                    store.forget()
                staging.reset(None)
            elif delta:
                store.forget()  # the base holds the version that did not load
            return result

    async def _apply(version: int, paths: list, in_flight: str):
        async def load(timeout: float):
            results = await asyncio.wait_for(
                engine_client.collective_rpc(
                    "mgrpo_load_files", kwargs=dict(paths=paths, expected=expected, optional=optional)
                ),
                timeout=timeout,
            )
            bad = [r for r in results if not r.get("ok")]
            if bad:
                raise UpdateFailed(bad[0]["error"], poisoned=any(r.get("poisoned") for r in bad))
            return results[0]["receipt"]

        return await apply_version(gate, update, engine_client, version, update_timeout_s, load, in_flight)

    @app.post("/mgrpo/interrupt")
    async def interrupt(request: Request):
        """A checkpoint of a partial run (issue 56; the colocated engine's `VLLMServer.interrupt`): every request in
        flight ends now with the tokens it has (vLLM's `pause_generation(mode="abort")`); their responses say so
        (`server.INTERRUPTED_HEADER`) and the trainer continues each from its prefix. Generation resumes at once.
        The body's `{"expect": n}`, the calls its trainer has in flight here, makes it wait (`vllm_settings.until`)
        for those still on the wire and then for vLLM to hold each, so none runs on in full."""
        async with update.lock:
            why = update.refusal(None) or update.claim(None, request.headers)
            if why:
                return error(409, why)
            t0, expect = time.perf_counter(), await _expected_calls(request)
            if expect is None:
                return error(400, 'the body is {"expect": <calls in flight here, an int >= 0>} or empty')
            await until(lambda: gate.generating >= expect)  # the calls its trainer sent are here
            await gate.pause(wait_for_calls=False)
            update.interrupts += 1
            try:
                requests, missed = await until_held(engine_client, lambda: gate.generating, expect)
                await asyncio.wait_for(
                    engine_client.pause_generation(mode="abort", clear_cache=False), update_timeout_s
                )
            finally:
                await _resume(gate, engine_client, True, update)
            return {"interrupted_requests": requests, "not_yet_generating": missed, "total_s": time.perf_counter() - t0}

    @app.get("/mgrpo/weights_digest")
    async def weights_digest():
        """xxh3_128 of every parameter of the loaded model, per worker (tests: deltas give bitwise a full push)."""
        return {"version": gate.version, "workers": await engine_client.collective_rpc("mgrpo_weights_digest")}

    @app.get("/mgrpo/version")
    async def version_info():
        return {
            "version": gate.version,
            "poisoned": update.poisoned,
            "updating": update.committing,
            "staged_version": staging.version,
            "staged": sorted(staging.buckets),
            "owner": update.owner.state(),
        }

    @app.get("/mgrpo/routes")
    async def routes():
        """Every route of this app (vLLM's and ours), for audits: each must answer 401 without the token."""
        return {
            "routes": [
                {"path": r.path, "methods": sorted(getattr(r, "methods", None) or [])}
                for r in app.routes
                if getattr(r, "path", None)
            ]
        }

    @app.get("/mgrpo/stats")
    async def stats():
        return {"requests_inflight": gate.inflight, "requests_served": gate.served, "version": gate.version}
