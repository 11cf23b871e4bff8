"""A guarded rollout server: vLLM's own OpenAI server (one AsyncLLM, our worker extension, `--generation-config
vllm`, processed logprobs) with mgrpo's guard and weight routes inside the same ASGI app, on one socket.

vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere; its dev, cache and weight routes stay open. Here
a pure-ASGI middleware in front of the whole app wants `Authorization: Bearer TOKEN` (compared in constant time)
on every path but `GET /health`, so no port serves any vLLM route unguarded, not even on loopback.

mgrpo's routes (all guarded):
    PUT  /mgrpo/weights/{version}/{index}   one bucket: safetensors bytes (payload + manifest) then their
                                            sha256 as 64 hex digits, streamed into a staging file and hashed
                                            as it arrives; the digest is checked and returned
    POST /mgrpo/weights/{version}/commit    {"count", "sha256": [...]}: pause generation (in-flight requests
                                            finish, new ones wait), load every staged bucket through the worker
                                            (complete, nothing unknown, shapes and dtypes), reset the prefix
                                            cache, stamp the version, resume
    GET  /mgrpo/version                     {"version", "poisoned", "staged"}: what a client asks before resending
    GET  /mgrpo/stats                       requests served and in flight
Every generation response carries `x-mgrpo-weight-version`: the weights that produced all of its tokens.
"""
# (no `from __future__ import annotations`: FastAPI reads the route signatures at runtime)

import asyncio
import hmac
import json
import os
import shutil
import tempfile
import time

TOKEN_ENV = "MGRPO_SERVER_TOKEN"
OPEN_PATHS = {("GET", "/health")}
VERSION_HEADER = "x-mgrpo-weight-version"


class Gate:
    """Generation waits while an update runs; an update waits for the requests in flight. Counts requests."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.inflight, self.updating, self.served, self.version = 0, False, 0, 0

    async def enter(self) -> int:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.inflight += 1
            return self.version

    async def leave(self) -> None:
        async with self.cond:
            self.inflight -= 1
            self.served += 1
            self.cond.notify_all()

    async def pause(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.updating = True
            await self.cond.wait_for(lambda: self.inflight == 0)

    async def resume(self) -> None:
        async with self.cond:
            self.updating = False
            self.cond.notify_all()


class Guard:
    """Pure ASGI (streaming bodies pass through untouched): the token on every route but GET /health; the gate
    and the weight-version header on every vLLM route."""

    def __init__(self, app, token: str, gate: Gate):
        self.app, self.token, self.gate = app, ("Bearer " + token).encode(), gate

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method, path = scope.get("method", "WS"), scope["path"]
        if (method, path) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(auth, self.token):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 4401})
            body = b'{"error": "missing or wrong token: send Authorization: Bearer <MGRPO_SERVER_TOKEN>"}'
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            return await send({"type": "http.response.body", "body": body})
        if path.startswith("/mgrpo/"):
            return await self.app(scope, receive, send)
        version = await self.gate.enter()

        async def stamped(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) +
                               [(VERSION_HEADER.encode(), str(version).encode())])
            await send(message)

        try:
            return await self.app(scope, receive, stamped)
        finally:
            await self.gate.leave()


class Staging:
    """Buckets of the version being received, as files in a private folder in /dev/shm (the worker maps them)."""

    def __init__(self, max_bytes: int):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.mkdtemp(prefix="mgrpo-staging-", dir=base)
        os.chmod(self.dir, 0o700)
        self.max_bytes, self.version, self.buckets = max_bytes, None, {}  # index -> (path, sha256)

    def reset(self, version: int | None) -> None:
        for path, _ in self.buckets.values():
            try:
                os.unlink(path)
            except OSError:
                pass
        self.version, self.buckets = version, {}

    def close(self) -> None:
        self.reset(None)
        shutil.rmtree(self.dir, ignore_errors=True)


def add_weight_routes(app, engine_client, gate: Gate, staging: Staging, expected: dict, optional: list) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from mgrpo.rollout.transports.http_buckets import StreamCheck

    state = {"poisoned": None}

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    @app.put("/mgrpo/weights/{version}/{index}")
    async def put_bucket(version: int, index: int, request: Request):
        size = int(request.headers.get("content-length") or -1)
        if not 0 < size <= staging.max_bytes:
            return error(413 if size > 0 else 411, f"bucket body of {size} bytes; send Content-Length, at most "
                                                   f"{staging.max_bytes} (--max-bucket-mb)")
        if staging.version != version:
            staging.reset(version)  # a new version: whatever was staged for another one is dropped
        path = os.path.join(staging.dir, f"v{version}-{index:06d}.bucket")
        got, check = 0, StreamCheck(size)
        try:
            with open(path, "wb") as f:
                async for chunk in request.stream():
                    got += len(chunk)
                    if got > size:
                        break
                    f.write(check.feed(chunk))
            if got != size:
                raise ValueError(f"{got} bytes arrived, Content-Length {size}")
            sha = check.finish()
        except ValueError as exc:  # BucketError is one
            os.unlink(path)
            return error(400, f"bucket {index} of version {version} rejected, nothing staged: {exc}")
        staging.buckets[index] = (path, sha)
        return {"index": index, "version": version, "bytes": size, "sha256": sha}

    @app.post("/mgrpo/weights/{version}/commit")
    async def commit(version: int, request: Request):
        body = await request.json()
        count, digests = int(body.get("count", -1)), list(body.get("sha256") or [])
        if state["poisoned"]:
            return error(409, f"the server holds a half-applied update and will not load another: "
                              f"{state['poisoned']}; restart it")
        have = {i: sha for i, (_, sha) in staging.buckets.items()} if staging.version == version else {}
        want = dict(enumerate(digests))
        if count != len(digests) or have != want:
            missing = sorted(set(want) - set(have))[:5]
            return error(409, f"version {version} is not completely staged (count {count}, staged {len(have)}, "
                              f"missing or different: {missing}); resend its buckets")
        paths = [staging.buckets[i][0] for i in range(count)]
        t0 = time.perf_counter()
        await gate.pause()
        try:
            t1 = time.perf_counter()
            results = await engine_client.collective_rpc(
                "mgrpo_load_files", kwargs=dict(paths=paths, expected=expected, optional=optional))
            t2 = time.perf_counter()
            bad = [r for r in results if not r.get("ok")]
            if bad:
                if any(r.get("poisoned") for r in bad):
                    state["poisoned"] = bad[0]["error"]
                return error(422, bad[0]["error"])
            await engine_client.reset_prefix_cache()
            gate.version = version
        finally:
            await gate.resume()
        staging.reset(None)
        t3 = time.perf_counter()
        return dict(results[0]["receipt"], version=version, pause_s=t1 - t0, load_s=t2 - t1, reset_s=t3 - t2,
                    total_s=t3 - t0)

    @app.get("/mgrpo/version")
    async def version_info():
        return {"version": gate.version, "poisoned": state["poisoned"], "staged_version": staging.version,
                "staged": sorted(staging.buckets)}

    @app.get("/mgrpo/routes")
    async def routes():
        """Every route of this app (vLLM's and ours), for audits: each must answer 401 without the token."""
        return {"routes": [{"path": r.path, "methods": sorted(getattr(r, "methods", None) or [])}
                           for r in app.routes if getattr(r, "path", None)]}

    @app.get("/mgrpo/stats")
    async def stats():
        return {"requests_inflight": gate.inflight, "requests_served": gate.served, "version": gate.version}


def vllm_args(model: str, host: str, port: int, dtype: str, seed: int, max_model_len: int | None,
              max_num_seqs: int, extra: list):
    """vLLM's own CLI namespace: our worker extension, nothing from generation_config.json, processed logprobs."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mgrpo.rollout.serving.vllm_settings import WORKER_EXTENSION, cpu_scheduling

    argv = ["--model", model, "--host", host, "--port", str(port), "--generation-config", "vllm",
            "--logprobs-mode", "processed_logprobs", "--dtype", dtype, "--seed", str(seed),
            "--worker-extension-cls", WORKER_EXTENSION["server"], "--enable-prefix-caching",
            "--max-num-seqs", str(max_num_seqs), "--disable-uvicorn-access-log", "--enforce-eager"]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    cpu = cpu_scheduling({"model": model, "max_model_len": max_model_len})  # {} with CUDA
    if cpu:  # seeded prefills must not be chunked on CPU (see vllm_settings.cpu_scheduling)
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cpu["max_num_batched_tokens"])]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv + list(extra))
    validate_parsed_serve_args(args)
    return args


async def serve(args, token: str, max_bucket_bytes: int, on_ready) -> None:
    """Start the engine, build vLLM's app, add the guard and our routes, serve on one socket until stopped."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from mgrpo.rollout.serving.vllm_settings import hf_manifest

    listen_address, sock = setup_server(args, reuse_port=False)  # binds first: a port in use fails here
    staging = Staging(max_bucket_bytes)
    try:
        async with build_async_engine_client(args) as engine_client:
            supported = await engine_client.get_supported_tasks()
            app = build_app(args, supported, engine_client.model_config)
            await init_app_state(engine_client, app.state, args, supported)
            dtype = str(engine_client.model_config.dtype).replace("torch.", "")
            expected, optional = hf_manifest(args.model, dtype)
            gate = Gate()
            add_weight_routes(app, engine_client, gate, staging, expected, optional)
            # outermost, around whatever vLLM built (its stack may already exist: add_middleware would refuse)
            app.middleware_stack = Guard(app.middleware_stack or app.build_middleware_stack(), token, gate)
            announce = asyncio.create_task(_announce_when_up(args.host, args.port, listen_address, on_ready))
            shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port, log_level="warning",
                                        access_log=False, timeout_keep_alive=300)  # returns when the server stops
            announce.cancel()
        await shutdown
    finally:
        staging.close()
        sock.close()


async def _announce_when_up(host: str, port: int, address: str, on_ready) -> None:
    """`on_ready(address)` once GET /health answers 200 on the served socket."""
    import aiohttp

    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        on_ready(address)
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
