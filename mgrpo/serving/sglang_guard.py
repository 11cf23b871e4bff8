"""mgrpo's guard in front of an SGLang server (`launch/rollout_server.py --engine sglang`).

SGLang's `--api-key` / `--admin-api-key` leave its routes open when unset, and its weight routes change the model.
So SGLang listens on loopback only, on a port of its own, with a random admin key that only this guard holds, and
the guard listens where the user asked (loopback by default; TLS off loopback, as for vLLM) and:

- wants `Authorization: Bearer TOKEN` (constant-time compare) on every route but `GET /health`;
- on every state-changing route (every POST but generation) also the trainer run's ownership headers
  (`ownership.py`): another run is refused (409) unless it takes over; versions of a run strictly increase;
- checks each `/update_weights_from_distributed` bucket (names, shapes) against the model's checkpoint before SGLang
  sees it, and lets `/update_weight_version` through only if every tensor arrived exactly once since
  `/begin_weight_update`. SGLang loads buckets as they arrive, so a refused or failed update poisons the server:
  503 on /health and generation until it is restarted (the trainer excludes it);
- answers `GET /mgrpo/version` ({version, owner, poisoned, workers}) as the vLLM server does, so the remote
  client's replica logic (exclusion, rejoin, ownership) is the same for both;
- counts the generation calls through it, and `POST /mgrpo/drain {timeout_s}` holds new ones and waits for the
  running ones to finish (a push that must not mix versions, mgrpo's "finish"; SGLang's pause mode `retract`
  would continue them on the new weights); `/continue_generation` releases them; `POST /mgrpo/interrupt` (a
  checkpoint of a partial run) aborts every call in flight with its tokens so far (SGLang's pause mode `abort`,
  then `/continue_generation`) and marks their answers `x-mgrpo-interrupted: 1`;
- forwards everything else to SGLang with the admin key (bodies and answers untouched).
"""

from __future__ import annotations

import hmac
import json
import os
import sys

from mgrpo.serving.ownership import ATTEMPT_HEADER, RUN_HEADER, TAKE_OVER_HEADER, Ownership
from mgrpo.serving.vllm_settings import until

GENERATION = {"/generate", "/v1/completions", "/v1/chat/completions"}
INTERRUPTED_HEADER = "x-mgrpo-interrupted"  # "1": POST /mgrpo/interrupt ran while this call was in flight
OPEN = {("GET", "/health")}


class Manifest:
    """The tensors one update must bring, each exactly once (names and shapes from the checkpoint's headers)."""

    def __init__(self, expected: dict, optional: list):
        self.expected, self.optional, self.seen = expected, set(optional), set()

    def add(self, body: dict) -> str | None:
        """Why this bucket request is refused, or None (then its names count as arrived)."""
        names, shapes = body.get("names") or [], body.get("shapes") or []
        if len(names) != len(shapes) or len(names) != len(body.get("dtypes") or []):
            return "names, dtypes and shapes differ in length"
        for name, shape in zip(names, shapes):
            if name in self.seen or names.count(name) > 1:
                return f"tensor {name!r} arrived twice in one update; send each tensor once"
            if name not in self.expected and name not in self.optional:
                return f"unknown tensor {name!r}: the sender's names do not match this model; fix the name mapping"
            if name in self.expected and list(shape) != list(self.expected[name][0]):
                return f"tensor {name!r} has shape {list(shape)}, the model has {list(self.expected[name][0])}"
        self.seen.update(names)
        return None

    def missing(self) -> list:
        return sorted(set(self.expected) - self.seen)


class GuardState:
    def __init__(self, expected: dict, optional: list, workers: int, log=print):
        self.expected, self.optional, self.workers = expected, optional, workers
        self.version, self.poisoned, self.manifest = 0, "", None
        self.ownership = Ownership(log)
        self.log = log
        self.gate = None  # asyncio.Condition, made in the server's loop (`drain`)
        self.inflight, self.draining = 0, None  # generation calls through the guard; the drain's release task
        self.interrupts = 0  # POST /mgrpo/interrupt calls begun: a call aborted under one is "interrupted"

    async def enter(self) -> None:
        """A generation call waits while a push drains the server (`drain`), then counts as in flight."""
        async with self.gate:
            await self.gate.wait_for(lambda: self.draining is None)
            self.inflight += 1

    async def leave(self) -> None:
        async with self.gate:
            self.inflight -= 1
            self.gate.notify_all()

    async def drain(self, timeout_s: float) -> int:
        """A push whose calls in flight must finish first (`rollout.partial` off: mgrpo's "finish"): new calls wait,
        the running ones end on the old weights; SGLang's own pause (mode `retract`) would instead continue them on
        the new weights. Released by `/continue_generation`, or after `timeout_s` if the pusher never comes back
        (a trainer killed mid-push must not stop generation for good). Returns the calls it waited for."""
        import asyncio

        async with self.gate:
            waited = self.inflight
            if self.draining is not None:  # a second push before the first one's /continue_generation
                self.draining.cancel()
            self.draining = asyncio.get_running_loop().call_later(timeout_s, self._release_later)
            try:
                await asyncio.wait_for(self.gate.wait_for(lambda: self.inflight == 0), timeout_s)
            except asyncio.TimeoutError:
                self.draining.cancel()
                self.draining = None
                self.gate.notify_all()
                raise
        return waited

    def _release_later(self) -> None:
        import asyncio

        self.log("a drain was not followed by /continue_generation in time: generation goes on")
        asyncio.ensure_future(self.release())

    async def release(self) -> None:
        async with self.gate:
            if self.draining is not None:
                self.draining.cancel()
                self.draining = None
            self.gate.notify_all()

    def refusal(self, headers, version: int | None) -> str | None:
        return self.ownership.refusal(
            headers.get(RUN_HEADER, ""), headers.get(ATTEMPT_HEADER, ""), version, headers.get(TAKE_OVER_HEADER) == "1"
        )

    def poison(self, why: str) -> None:
        if not self.poisoned:
            self.log(f"poisoned: {why}")
        self.poisoned = why


def make_app(upstream: str, admin_key: str, token: str, state: GuardState):
    """The guard as an aiohttp application (upstream: SGLang's own loopback URL)."""
    import aiohttp
    from aiohttp import web

    bearer = ("Bearer " + token).encode()

    def refuse(status: int, why: str):
        return web.json_response({"error": why}, status=status)

    async def forward(request: web.Request, body: bytes | None = None, path: str | None = None) -> web.Response:
        """The request to SGLang with the admin key (`path`: another route, e.g. a step of /mgrpo/interrupt)."""
        session: aiohttp.ClientSession = request.app["session"]
        data = await request.read() if body is None else body
        headers = {"Authorization": f"Bearer {admin_key}"}
        if request.content_type:
            headers["Content-Type"] = request.content_type
        try:
            async with session.request(
                request.method, upstream + (path or request.path_qs), data=data or None, headers=headers
            ) as resp:
                payload = await resp.read()
                return web.Response(body=payload, status=resp.status, content_type=resp.content_type)
        except aiohttp.ClientError as exc:  # gone (a restarted SGLang holds its start weights: not poisoned)
            resp = refuse(502, f"SGLang behind this guard does not answer ({type(exc).__name__}: {exc})")
            resp.headers["x-mgrpo-upstream"] = "unreachable"
            return resp

    async def upstream_version(request: web.Request) -> None:
        """SGLang's own weight version is the truth: a restarted SGLang holds its start weights again (its version
        is then not ours, e.g. "0" or "default": -1), whatever this guard last let through; an update it was
        taking is gone with it."""
        try:
            async with request.app["session"].get(
                upstream + "/model_info",
                headers={"Authorization": f"Bearer {admin_key}"},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                seen = (await resp.json()).get("weight_version") if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError, TimeoutError):
            return
        if seen is not None and str(seen) != str(state.version):
            state.log(f"SGLang reports weight version {seen!r}, not {state.version}: it was restarted")
            state.version = int(seen) if str(seen).lstrip("-").isdigit() else -1
            state.manifest = None

    async def handle(request: web.Request) -> web.Response:
        method, path = request.method, request.path
        if (method, path) in OPEN:
            if state.poisoned:
                return refuse(503, f"poisoned: {state.poisoned}; restart the server")
            return await forward(request)
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), bearer):
            return web.json_response(
                {"error": "missing or wrong token: send Authorization: Bearer <MGRPO_SERVER_TOKEN>"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if path == "/mgrpo/version":
            await upstream_version(request)
            return web.json_response(
                {
                    "version": state.version,
                    "owner": state.ownership.state(),
                    "poisoned": state.poisoned or None,
                    "workers": state.workers,
                    "engine": "sglang",
                    "generating": state.inflight,
                    "draining": state.draining is not None,
                }
            )
        if path in GENERATION:
            if state.poisoned:
                return refuse(503, f"poisoned: {state.poisoned}; restart the server")
            await state.enter()
            interrupts = state.interrupts
            try:
                resp = await forward(request)
            finally:
                await state.leave()
            if state.interrupts != interrupts:  # its answer may be cut short by POST /mgrpo/interrupt
                resp.headers[INTERRUPTED_HEADER] = "1"
            return resp
        if method in ("GET", "HEAD"):
            return await forward(request)
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return refuse(400, f"{path}: the body is not JSON")
        version = None
        if path == "/update_weight_version":
            try:
                version = int(body.get("new_version"))
            except (TypeError, ValueError):
                return refuse(400, "/update_weight_version: new_version must be an integer version (as a string)")
        why = state.refusal(request.headers, version)
        if why:
            return refuse(409, why)
        if path == "/mgrpo/interrupt":  # a checkpoint of a partial run: every call ends now with its tokens so far
            expect = body.get("expect", 0) if isinstance(body, dict) else None
            if type(expect) is not int or not 0 <= expect < 1 << 20:
                return refuse(400, '/mgrpo/interrupt: the body is {"expect": <calls in flight here, an int >= 0>}')
            await until(lambda: state.inflight >= expect)  # the calls its trainer sent are here (`vllm_settings`)
            waited = state.inflight
            state.interrupts += 1
            try:
                paused = await forward(request, json.dumps({"mode": "abort"}).encode(), path="/pause_generation")
            finally:  # generation resumes whatever the pause said
                resumed = await forward(request, b"{}", path="/continue_generation")
            for step, resp in (("/pause_generation", paused), ("/continue_generation", resumed)):
                if resp.status != 200:
                    return refuse(502, f"SGLang refused {step} ({resp.status}): {resp.body[:200]!r}")
            return web.json_response({"interrupted_requests": waited})
        if path == "/mgrpo/drain":
            timeout_s = body.get("timeout_s", 600)
            if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
                return refuse(400, f"/mgrpo/drain: timeout_s={timeout_s!r}; seconds in (0, 86400]")
            try:
                return web.json_response({"waited_for": await state.drain(timeout_s)})
            except TimeoutError:
                return refuse(503, f"generation calls in flight did not finish within {timeout_s:g} s")
        if path == "/begin_weight_update":
            state.manifest = Manifest(state.expected, state.optional)
        elif path == "/update_weights_from_distributed":
            if state.manifest is None:
                return refuse(
                    409,
                    "/update_weights_from_distributed outside /begin_weight_update ... "
                    "/end_weight_update; begin the update first",
                )
            why = state.manifest.add(body)
            if why:
                state.poison(f"update refused half-way: {why}")
                return refuse(400, why)
        elif path == "/update_weight_version":
            if state.manifest is None:  # nothing was sent: nothing to poison
                return refuse(409, f"version {version}: no update in progress (/begin_weight_update first)")
            missing = state.manifest.missing()
            if missing:
                state.poison(
                    f"version {version} incomplete: {len(missing)} tensors never arrived ({', '.join(missing[:3])}...)"
                )
                return refuse(
                    409,
                    f"version {version} is incomplete: {len(missing)} tensors of the model never "
                    f"arrived, e.g. {missing[:3]}; the server is poisoned (it loaded part of it)",
                )
        resp = await forward(request, raw)
        if path == "/update_weights_from_distributed" and resp.status != 200 and "x-mgrpo-upstream" not in resp.headers:
            state.poison(f"SGLang failed a bucket of an update ({resp.status}): {resp.body[:200]!r}")
        if path == "/update_weight_version" and resp.status == 200:
            state.version, state.manifest = version, None
            state.ownership.committed(version)
        if path == "/continue_generation":
            await state.release()  # after SGLang resumed: the calls that waited go to a running server
        return resp

    async def start(app):
        import asyncio

        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        state.gate = asyncio.Condition()

    async def stop(app):
        await app["session"].close()

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def serve(
    upstream: str,
    admin_key: str,
    token: str,
    host: str,
    port: int,
    model_dir: str,
    workers: int,
    ssl_context=None,
    on_ready=None,
    child=None,
) -> None:
    """Serve the guard until stopped (blocking); with `child` (the SGLang process it started), stop when it dies:
    a guard without its engine would look alive to the trainer."""
    from aiohttp import web

    from mgrpo.serving.vllm_settings import hf_manifest

    expected, optional = hf_manifest(model_dir, "any")
    state = GuardState(
        expected, optional, workers, log=lambda m: print(f"mgrpo guard: {m}", file=sys.stderr, flush=True)
    )
    app = make_app(upstream.rstrip("/"), admin_key, token, state)
    if child is not None:
        import asyncio

        async def watch(_app):
            async def loop():
                while child.poll() is None:
                    await asyncio.sleep(1.0)
                state.log(f"SGLang exited ({child.returncode}); the guard stops too")
                os._exit(1)

            _app["watch"] = asyncio.create_task(loop())

        app.on_startup.append(watch)
    address = f"{'https' if ssl_context else 'http'}://{host}:{port}"
    web.run_app(
        app,
        host=host,
        port=port,
        ssl_context=ssl_context,
        handle_signals=True,
        access_log=None,
        shutdown_timeout=1.0,
        print=lambda *_: (on_ready or print)(address),
    )


def sglang_command(model: str, port: int, admin_key: str, extra: list) -> list:
    """SGLang's own server on loopback, its own port, every route behind the admin key (only the guard has it);
    token ids in and out (`--skip-tokenizer-init`), mgrpo's versions from 0."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        admin_key,
        "--admin-api-key",
        admin_key,
        "--skip-tokenizer-init",
        "--weight-version",
        "0",
        *extra,
    ]


def start_sglang(model: str, admin_key: str, extra: list, timeout_s: float = 1800.0):
    """(process, URL) of an SGLang server started for the guard, once its /health answers; raises with the tail
    of its log if it exits first. SGLANG_RETURN_ORIGINAL_LOGPROB must not be set: logprobs would ignore T."""
    import subprocess
    import tempfile
    import time

    import httpx

    from mgrpo.parallel.distributed import free_port

    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0") not in ("", "0", "false"):
        raise ValueError(
            "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return logprobs before temperature, "
            "not those of the distribution it samples from; unset it"
        )
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="sglang-", suffix=".log", delete=False)
    env = {k: v for k, v in os.environ.items() if k != "MGRPO_SERVER_TOKEN"}
    proc = subprocess.Popen(
        sglang_command(model, port, admin_key, extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(
                f"SGLang exited ({proc.returncode}) before serving; the end of its log "
                f"({log.name}):\n{log.read()[-3000:]}"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"SGLang did not answer /health within {timeout_s:g} s (log: {log.name})")


def server_info(upstream: str, admin_key: str, timeout: float = 10.0) -> dict:
    import httpx

    try:
        resp = httpx.get(
            upstream.rstrip("/") + "/get_server_info", headers={"Authorization": f"Bearer {admin_key}"}, timeout=timeout
        )
        resp.raise_for_status()
        return resp.json()
    except (httpx.HTTPError, ValueError) as exc:  # OSError: what the server's launcher reports in one line
        raise OSError(f"{upstream}/get_server_info: {exc or type(exc).__name__}") from None
