"""A guarded rollout server: vLLM's own OpenAI server (one AsyncLLM, our worker extension, `--generation-config
vllm`, processed logprobs) with mgrpo's guard and weight routes inside the same ASGI app, on one socket.

vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere; its dev, cache and weight routes stay open. Here
a pure-ASGI middleware in front of the whole app wants `Authorization: Bearer TOKEN` (compared in constant time)
on every path but `GET /health`, so no port serves any vLLM route unguarded, not even on loopback.

mgrpo's weight routes (all guarded) and what keeps an update whole: `weight_routes.py`; where buckets wait for
their commit: `staging.py`. Every generation response carries `x-mgrpo-weight-version`: the weights that produced
all of its tokens. A poisoned server (a load that failed half-way or ran past its deadline) answers 503 on
GET /health and every generation route.
"""
# (no `from __future__ import annotations`: FastAPI reads the route signatures at runtime)

import asyncio
import hmac
import json

TOKEN_ENV = "MGRPO_SERVER_TOKEN"
OPEN_PATHS = {("GET", "/health")}
VERSION_HEADER = "x-mgrpo-weight-version"
INTERRUPTED_HEADER = "x-mgrpo-interrupted"  # "1": POST /mgrpo/interrupt ran while this request was in flight
TOKENS_PATH = "/inference/v1/generate"  # vLLM's token-in-token-out route (`--enable-scale-out`): version spans
MAX_GENERATE_BODY = 64 << 20
GENERATION = {TOKENS_PATH, "/v1/completions", "/v1/chat/completions"}  # POSTed: a call vLLM generates for


class Gate:
    """Generation waits while an update runs; an update waits for the requests in flight. Counts requests."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.inflight, self.updating, self.served, self.version = 0, False, 0, 0
        self.generating = 0  # of `inflight`, the generation calls (an interrupt waits until vLLM holds them)

    async def enter(self, generation: bool = False) -> int:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.inflight += 1
            self.generating += generation
            return self.version

    async def leave(self, generation: bool = False) -> None:
        async with self.cond:
            self.inflight -= 1
            self.generating -= generation
            self.served += 1
            self.cond.notify_all()

    async def pause(self, wait_for_calls: bool = True) -> None:
        """New requests wait from now on; the ones in flight finish first unless `wait_for_calls` is false (a
        partial push: vLLM's own pause holds them, `weight_routes._apply_version`)."""
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.updating = True
            if wait_for_calls:
                await self.cond.wait_for(lambda: self.inflight == 0)

    async def resume(self) -> None:
        async with self.cond:
            self.updating = False
            self.cond.notify_all()


class Guard:
    """Pure ASGI (streaming bodies pass through untouched, but for the token route's small JSON, salted): the token
    on every route but GET /health; the gate and the weight-version header on every vLLM route; while the server is
    poisoned (`update.poisoned`), 503 with the reason on GET /health and on every vLLM route."""

    def __init__(self, app, token: str, gate: Gate, update=None):
        self.app, self.token, self.gate, self.update = app, ("Bearer " + token).encode(), gate, update

    async def unavailable(self, send) -> None:
        await _answer(send, 503, f"poisoned: {self.update.poisoned}; restart the server")

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method, path = scope.get("method", "WS"), scope["path"]
        poisoned = self.update is not None and self.update.poisoned
        if (method, path) in OPEN_PATHS:
            return await (self.unavailable(send) if poisoned else self.app(scope, receive, send))
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(auth, self.token):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 4401})
            body = b'{"error": "missing or wrong token: send Authorization: Bearer <MGRPO_SERVER_TOKEN>"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            return await send({"type": "http.response.body", "body": body})
        if path.startswith("/mgrpo/"):
            return await self.app(scope, receive, send)
        if poisoned:
            return await self.unavailable(send)
        generation = method == "POST" and path in GENERATION
        version = await self.gate.enter(generation)
        interrupts = self.update.interrupts if self.update is not None else 0
        if (method, path) == ("POST", TOKENS_PATH):
            try:
                scope, receive = await salted(scope, receive, version)
            except ValueError as exc:
                await self.gate.leave(generation)
                return await _answer(send, 413, str(exc))

        async def stamped(message):
            if message["type"] == "http.response.start":
                stamp = [(VERSION_HEADER.encode(), str(version).encode())]
                if self.update is not None and self.update.interrupts != interrupts:
                    stamp.append((INTERRUPTED_HEADER.encode(), b"1"))
                message = dict(message, headers=list(message.get("headers", [])) + stamp)
            await send(message)

        try:
            return await self.app(scope, receive, stamped)
        finally:
            await self.gate.leave(generation)


async def salted(scope, receive, version: int) -> tuple:
    """The request body with `cache_salt` set to the weights it enters under: a partial push cannot reset vLLM's
    prefix cache while held requests keep their blocks, so a request that starts later must not hit a block
    computed under other weights (the colocated engine salts the same way, `vllm_child.py`). A body that is not
    a JSON object passes as it came, for vLLM to answer."""
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return scope, _replay(message, receive)
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > MAX_GENERATE_BODY:
            raise ValueError(f"a generate body over {MAX_GENERATE_BODY} bytes")
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            body = json.dumps(dict(data, cache_salt=f"mgrpo-weights-{version}")).encode()
    except ValueError:
        pass
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
    scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
    return scope, _replay({"type": "http.request", "body": body, "more_body": False}, receive)


def _replay(first: dict, receive):
    """`first`, then whatever the client sends next (a disconnect: vLLM aborts the request on it)."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def vllm_args(
    model: str, host: str, port: int, dtype: str, seed: int, max_model_len: int | None, max_num_seqs: int, extra: list
):
    """vLLM's own CLI namespace: our worker extension, nothing from generation_config.json, processed logprobs."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mgrpo.serving.vllm_settings import WORKER_EXTENSION, cpu_scheduling

    argv = [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--worker-extension-cls",
        WORKER_EXTENSION["server"],
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
        "--disable-uvicorn-access-log",
        "--enforce-eager",
        "--enable-scale-out",  # token-in-token-out /inference/v1/generate: per-token weight versions (partial)
    ]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    cpu = cpu_scheduling({"model": model, "max_model_len": max_model_len})  # {} with CUDA
    if cpu:  # seeded prefills must not be chunked on CPU (see vllm_settings.cpu_scheduling)
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cpu["max_num_batched_tokens"])]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv + list(extra))
    validate_parsed_serve_args(args)
    return args


def staging_caps(expected: dict, optional: list, max_staged_bytes: int | None, max_staged_buckets: int | None):
    """Per-version caps from the model: a bucket holds at least one tensor; the bytes at most twice the model's."""
    import math

    from mgrpo.weights.bucket import DTYPES

    model = sum(math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in expected.values())
    return (max_staged_bytes or 2 * model + (64 << 20)), (max_staged_buckets or len(expected) + len(optional))


async def serve(
    args,
    token: str,
    max_bucket_bytes: int,
    on_ready,
    update_timeout_s: float = 600.0,
    max_staged_bytes: int | None = None,
    max_staged_buckets: int | None = None,
    collective: dict | None = None,
) -> None:
    """Start the engine, build vLLM's app, add the guard and our routes, serve on one socket until stopped."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    from mgrpo.serving import vllm_worker  # noqa: F401  (on CPU: vLLM's idle busy-polling shortened here and
    from mgrpo.serving.lora_routes import add_lora_routes

    #                                               in the engine core this process starts, see vllm_worker)
    from mgrpo.serving.staging import Staging
    from mgrpo.serving.vllm_settings import hf_manifest
    from mgrpo.serving.weight_routes import UpdateState, add_weight_routes

    listen_address, sock = setup_server(args, reuse_port=False)  # binds first: a port in use fails here
    staging = Staging(max_bucket_bytes)
    try:
        async with build_async_engine_client(args) as engine_client:
            supported = await engine_client.get_supported_tasks()
            app = build_app(args, supported, engine_client.model_config)
            await init_app_state(engine_client, app.state, args, supported)
            dtype = str(engine_client.model_config.dtype).replace("torch.", "")
            expected, optional = hf_manifest(args.model, dtype)
            staging.max_total_bytes, staging.max_buckets = staging_caps(
                expected, optional, max_staged_bytes, max_staged_buckets
            )
            gate, update = Gate(), UpdateState()
            await engine_client.engine_core.set_weight_version_async(str(gate.version))  # vLLM's own: "default"
            add_weight_routes(app, engine_client, gate, staging, update, expected, optional, update_timeout_s)
            add_lora_routes(app, engine_client, gate, staging, update, update_timeout_s)  # 409 unless --enable-lora
            if collective:  # --transport collective: {host, backend, join_timeout_s}
                from mgrpo.serving.collective_routes import add_collective_routes

                add_collective_routes(
                    app, engine_client, gate, update, expected, optional, update_timeout_s, **collective
                )
            # outermost, around whatever vLLM built (its stack may already exist: add_middleware would refuse)
            app.middleware_stack = Guard(app.middleware_stack or app.build_middleware_stack(), token, gate, update)
            announce = asyncio.create_task(
                _announce_when_up(
                    args.host, args.port, listen_address, on_ready, tls=bool(getattr(args, "ssl_certfile", None))
                )
            )
            shutdown = await serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level="warning",
                access_log=False,
                timeout_keep_alive=300,  # returns when the server stops
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
            )
            announce.cancel()
        await shutdown
    finally:
        staging.close()
        sock.close()


async def _announce_when_up(host: str, port: int, address: str, on_ready, tls: bool = False) -> None:
    """`on_ready(address)` once GET /health answers 200 on the served socket (its own certificate not checked:
    this only asks whether the socket serves)."""
    import aiohttp

    url = f"{'https' if tls else 'http'}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/health"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            try:
                async with session.get(url, ssl=False if tls else None) as r:
                    if r.status == 200:
                        on_ready(address)
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
