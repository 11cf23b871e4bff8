"""`remote` backend: the Engine protocol over HTTP to guarded rollout servers (`launch/rollout_server.py`), each a
replica with the whole model.

Generation: token ids in (`/v1/completions` with a token-id prompt), token ids, processed logprobs and the weight
version (`x-mgrpo-weight-version`) out. Requests go to the replica with the fewest in flight, at most
`rollout.remote.max_inflight_per_server` each; a request that fails to connect, times out or gets a 5xx is retried
on another replica after a backoff (`retries` times). A replica where nothing listens is excluded at once, one that
times out or answers 5xx after `max_consecutive_failures` failed requests in a row (a timeout may be queueing); it
rejoins at the next weight update once GET /health answers again (not poisoned) and it has loaded that update.
Only when no replica is left does the call fail, with one line naming every server and why.

Weight updates name this trainer run (`rollout.remote.run_id`: random for a fresh run, the checkpoint's when
resumed) and this process; a server that another run owns is refused at start unless `rollout.remote.take_over`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from dataclasses import dataclass, field

from mgrpo.netutil import ServerCallError, http_json, tls_context
from mgrpo.rollout.engine import Capabilities, in_flight_mode, register_engine
from mgrpo.rollout.types import GenerationResponse, SamplingParams

VERSION_HEADER = "x-mgrpo-weight-version"
TOKENS_PATH = "/inference/v1/generate"  # vLLM's token-in-token-out route (the server runs --enable-scale-out)
INTERRUPTED_HEADER = "x-mgrpo-interrupted"  # the server interrupted the response (a checkpoint of a partial run)


class RemoteEngineError(RuntimeError):
    """No replica could serve; the message names each server and its last error."""


@dataclass
class Replica:
    url: str
    up: bool = True
    version: int | None = None  # what it holds as far as this client knows (None: unknown, ask it)
    inflight: int = 0
    served: int = 0
    failures: int = 0
    consecutive: int = 0  # failed requests in a row; excluded at rollout.remote.max_consecutive_failures
    last_error: str = ""
    name: str = field(init=False)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        self.name = self.url.split("://", 1)[-1]


def server_token(token_file: str = "") -> str:
    token = os.environ.get("MGRPO_SERVER_TOKEN", "").strip()
    if not token and token_file:
        with open(token_file) as f:
            token = f.read().strip()
    if not token:
        raise RemoteEngineError(
            "no token for the rollout servers: set MGRPO_SERVER_TOKEN or "
            "rollout.remote.token_file (the servers refuse every route without it)"
        )
    return token


class RemoteEngine:
    capabilities = Capabilities(async_generate=True, sleep=False, logprobs="processed")
    name = "remote"

    def __init__(
        self,
        servers: list,
        token: str,
        eos_token_id: int | None,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
        max_inflight_per_server: int = 64,
        retries: int = 2,
        backoff_s: float = 0.5,
        update_timeout_s: float = 600.0,
        log=None,
        ca_file: str = "",
        checksum: str = "xxh3_128",
        max_consecutive_failures: int = 3,
        run_id: str = "",
        take_over: bool = False,
        delta: bool = False,
        full_every: int = 0,
        in_flight: str = "finish",
    ):
        if not servers:
            raise RemoteEngineError("rollout.servers is empty; give the URLs of the rollout servers")
        self.replicas = [Replica(u) for u in servers]
        self.token, self.eos = token, eos_token_id
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        self.max_inflight, self.retries, self.backoff_s = max_inflight_per_server, retries, backoff_s
        self.update_timeout_s = update_timeout_s
        self.ssl = tls_context(ca_file)  # https: checked against ca_file (else the system's CAs)
        self.checksum = checksum  # the per-bucket digest on the wire (rollout.remote.checksum)
        self.delta, self.full_every = delta, full_every  # rollout.remote.delta / full_every (HTTP weight sync)
        self.in_flight = in_flight  # what a push does to requests in flight (rollout.partial: engine.in_flight_mode)
        self.max_consecutive_failures = max_consecutive_failures
        self.version = 0  # the version every serving replica must hold
        self.adapter = None  # LoRA adapter-only sync: the adapter name generation asks for (`model`)
        self.log = log or (lambda msg: print(f"mgrpo: {msg}", file=sys.stderr, flush=True))
        self.headers = {"Authorization": f"Bearer {token}"}
        self.run_id, self.attempt = run_id or secrets.token_hex(8), secrets.token_hex(4)
        self.take_over = take_over
        owned = []
        for r in self.replicas:  # start with those that answer; the others rejoin at a weight update
            try:
                info = self.get(r, "/mgrpo/version")
                if info.get("poisoned"):
                    raise RemoteEngineError(f"rollout server {r.name} is poisoned: {info['poisoned']}")
                r.version = info["version"]
                owner = (info.get("owner") or {}).get("run")
                if owner not in (None, self.run_id):
                    owned.append(f"{r.name} (run {owner}, version {r.version})")
            except RemoteEngineError as exc:
                self.mark_down(r, str(exc))
        if owned and not take_over:
            raise RemoteEngineError(
                f"rollout servers {', '.join(owned)} take weights from another trainer run, not "
                f"this one ({self.run_id}): stop that trainer, or set rollout.remote.take_over: "
                f"true to take them over"
            )
        if not any(r.up for r in self.replicas):
            raise self.no_replica_left()
        self.version = max(r.version for r in self.replicas if r.up)
        stale = [r.name for r in self.replicas if r.up and r.version != self.version]
        if stale:
            self.log(
                f"rollout servers {', '.join(stale)} hold an older weight version; they serve again after "
                f"the next weight update"
            )

    # -- plain HTTP for control calls (stdlib; no event loop needed) ---------------------------------------------
    def get(self, replica: Replica, path: str, timeout: float | None = None) -> dict:
        return self.call(replica, "GET", path, timeout=timeout)

    def post(self, replica: Replica, path: str, body: dict, timeout: float | None = None) -> dict:
        """A state-changing call: it carries this run and process (serving/ownership.py)."""
        return self.call(replica, "POST", path, body, timeout, self.update_headers())

    def call(
        self,
        replica: Replica,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: float | None = None,
        headers: dict | None = None,
    ) -> dict:
        try:
            return http_json(
                replica.url,
                method,
                path,
                body,
                headers or self.headers,
                timeout or self.connect_timeout_s,
                self.ssl,
                replica.name,
            )
        except ServerCallError as exc:
            raise RemoteEngineError(str(exc)) from None

    def serving(self) -> list:
        return [r for r in self.replicas if r.up and r.version == self.version]

    def mark_down(self, replica: Replica, error: str) -> None:
        if replica.up:
            self.log(
                f"rollout server {replica.name} excluded: {error}; it rejoins after it answers /health and "
                f"has loaded the current weights"
            )
        replica.up, replica.last_error, replica.failures = False, error, replica.failures + 1

    def no_replica_left(self) -> RemoteEngineError:
        why = "; ".join(
            f"{r.name}: {r.last_error or f'holds weight version {r.version}, not {self.version}'}"
            for r in self.replicas
        )
        return RemoteEngineError(f"no rollout server left ({why})")

    # -- generation ------------------------------------------------------------------------------------------------
    async def generate(self, requests: list, sampling: SamplingParams) -> list:
        import httpx

        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s)
        limits = httpx.Limits(max_connections=self.max_inflight * len(self.replicas), max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, headers=self.headers, limits=limits, verify=self.ssl) as client:
            cond = asyncio.Condition()
            return list(await asyncio.gather(*(self._one(client, cond, req, sampling) for req in requests)))

    async def _pick(self, cond: asyncio.Condition, avoid: set) -> Replica:
        async with cond:
            while True:
                live = self.serving()
                if not live:
                    raise self.no_replica_left()
                choices = [r for r in live if r.name not in avoid] or live
                free = [r for r in choices if r.inflight < self.max_inflight]
                if free:
                    best = min(free, key=lambda r: (r.inflight, r.served))
                    best.inflight += 1
                    return best
                await cond.wait()

    async def _release(self, cond: asyncio.Condition, replica: Replica) -> None:
        async with cond:
            replica.inflight -= 1
            cond.notify_all()

    async def _one(self, client, cond, req, sampling: SamplingParams) -> GenerationResponse:
        """One request: the least-loaded serving replica not tried yet; a timeout, a 5xx or a connection error is
        retried on another after a backoff (tenacity: backoff_s x 2^attempt, retries + 1 attempts in all)."""
        import httpx
        from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

        body = self.request_body(req, sampling)
        tried, last = set(), [""]
        attempts = AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            retry=retry_if_exception_type(_Retry),
            wait=wait_exponential(multiplier=self.backoff_s, max=60.0),
        )
        try:
            async for attempt in attempts:
                with attempt:
                    replica = await self._pick(cond, tried)
                    tried.add(replica.name)
                    try:
                        resp = await client.post(replica.url + self.generate_path, json=body)
                        if resp.status_code >= 500:
                            raise _Retry(f"{resp.status_code} {resp.text[:200]}")
                        if resp.status_code != 200:  # 4xx: our request is wrong; retrying elsewhere would not help
                            raise RemoteEngineError(
                                f"rollout server {replica.name}: {self.generate_path} -> "
                                f"{resp.status_code} {resp.text[:300]}"
                            )
                        replica.served, replica.consecutive = replica.served + 1, 0
                        return self.parse_response(resp.json(), resp.headers, replica.name)
                    except (_Retry, httpx.TransportError, OSError) as exc:
                        what = (
                            f"timed out after {self.request_timeout_s:g} s"
                            if isinstance(exc, httpx.TimeoutException)
                            else f"{type(exc).__name__}: {exc}"
                        )
                        last[0] = f"{replica.name}: {what}"
                        replica.consecutive += 1
                        # gone (nothing listens) -> out at once; slow or 5xx (it may only be queueing) -> after N
                        if isinstance(exc, httpx.ConnectError) or replica.consecutive >= self.max_consecutive_failures:
                            self.mark_down(replica, what)
                        raise _Retry(what) from None
                    finally:
                        await self._release(cond, replica)
        except (_Retry, RetryError):
            pass
        raise (
            self.no_replica_left()
            if not self.serving()
            else RemoteEngineError(
                f"request {req.request_id} failed on {len(tried)} rollout servers ({self.retries + 1} attempts); last: "
                f"{last[0]}"
            )
        )

    # -- the dialect: vLLM behind mgrpo's server (engines/sglang.py has SGLang's /generate) -----------------------
    # /v1/completions, one version per response (the header); with rollout.partial a response may span versions,
    # so it goes to vLLM's token-in-token-out route, whose choices carry `weight_versions` spans.
    @property
    def generate_path(self) -> str:
        return "/v1/completions" if self.in_flight == "finish" else TOKENS_PATH

    def request_body(self, req, sampling: SamplingParams) -> dict:
        params = {
            "max_tokens": req.max_tokens or sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "seed": int(req.seed),
            "logprobs": 0,
            "ignore_eos": sampling.ignore_eos,
            "skip_special_tokens": False,
            "n": 1,
            "stop_token_ids": [self.eos] if self.eos is not None and not sampling.ignore_eos else [],
        }
        model = {"model": self.adapter} if self.adapter else {}
        if self.in_flight != "finish":  # the server salts it with the version it enters under (server.salted)
            return {"token_ids": list(req.prompt_ids), "sampling_params": dict(params, detokenize=False), **model}
        return {"prompt": list(req.prompt_ids), "return_token_ids": True, **params, **model}

    def parse_response(self, data: dict, headers, server: str) -> GenerationResponse:
        return _response(data, headers, server)

    # -- weights ---------------------------------------------------------------------------------------------------
    def weight_transport(self, bucket_bytes: int, **kwargs):
        from mgrpo.weights.transports.http_buckets import HttpBucketTransport

        return HttpBucketTransport(
            self,
            bucket_bytes,
            **dict(
                dict(
                    update_timeout_s=self.update_timeout_s,
                    algo=self.checksum,
                    delta=self.delta,
                    full_every=self.full_every,
                ),
                **kwargs,
            ),
        )

    def interrupt(self) -> dict:
        """End the requests in flight on every serving replica with their tokens so far ("interrupted"): a checkpoint
        of a partial run stores them and continues each from its prefix (`RolloutProducer.settle`)."""
        done = [
            self.post(r, "/mgrpo/interrupt", {"expect": r.inflight}, timeout=self.update_timeout_s)  # sent, maybe not
            for r in self.serving()  # arrived yet: the server waits for them (`weight_routes.interrupt`)
        ]
        return {key: sum(x.get(key, 0) for x in done) for key in ("interrupted_requests", "not_yet_generating")}

    def load_adapter(self, folder: str, version: int) -> dict:
        """LoRA adapter-only sync: PUT the PEFT folder's two files to every replica that can take it (serving/
        lora_routes.py); generation then names the adapter. A replica that fails is excluded (the others serve)."""
        import json

        from mgrpo.serving.lora_routes import CONFIG_HEADER

        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.dumps(json.load(f))
        with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
            body = f.read()
        receipts = {}
        for r in self.rejoin_candidates():
            try:
                receipts[r.name] = self.call(
                    r,
                    "PUT",
                    f"/mgrpo/lora/{version}",
                    body,
                    self.update_timeout_s,
                    dict(self.update_headers(), **{CONFIG_HEADER: config}),
                )
                r.version = version
            except RemoteEngineError as exc:
                self.mark_down(r, str(exc))
        if not receipts:
            raise self.no_replica_left()
        self.version, self.adapter = version, receipts[next(iter(receipts))]["adapter"]
        return {"servers": receipts, "version": version}

    def update_headers(self) -> dict:
        """What every PUT and commit carries: the token, this run and this process (serving/ownership.py)."""
        from mgrpo.serving.ownership import ATTEMPT_HEADER, RUN_HEADER, TAKE_OVER_HEADER

        return dict(
            self.headers,
            **{RUN_HEADER: self.run_id, ATTEMPT_HEADER: self.attempt},
            **({TAKE_OVER_HEADER: "1"} if self.take_over else {}),
        )

    def rejoin_candidates(self) -> list:
        """Replicas to push the next update to: those up, and those down that answer /health again."""
        out = []
        for r in self.replicas:
            if not r.up:
                try:
                    _health(r.url, 2.0, self.ssl)
                    info = self.get(r, "/mgrpo/version", timeout=5.0)
                    if info.get("poisoned"):  # a poisoned server serves nothing until restarted
                        continue
                    r.version = info["version"]
                    self.log(
                        f"rollout server {r.name} answers again (weight version {r.version}); it gets the "
                        f"next update before it serves"
                    )
                    r.up = True
                except (RemoteEngineError, OSError):
                    continue
            out.append(r)
        return out

    def health(self) -> dict:
        return {
            "engine": self.name,
            "version": self.version,
            "servers": {
                r.name: {"up": r.up, "version": r.version, "served": r.served, "error": r.last_error}
                for r in self.replicas
            },
        }

    def stats(self, reset: bool = False) -> dict:
        return {
            "requests_inflight": sum(r.inflight for r in self.replicas),
            "requests_served": sum(r.served for r in self.replicas),
            "servers": {r.name: r.served for r in self.replicas},
        }

    def close(self) -> None:
        pass


class _Retry(Exception):
    """A generation attempt worth another replica: a timeout, a 5xx, a connection error."""


def _health(url: str, timeout: float, context=None) -> None:
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout, verify=context if context is not None else True)
    except httpx.HTTPError as exc:
        raise OSError(f"/health: {exc or type(exc).__name__}") from None
    if resp.status_code != 200:
        raise OSError(f"/health -> {resp.status_code}")


def _response(data: dict, headers, server: str) -> GenerationResponse:
    """One choice of /v1/completions (`logprobs.token_logprobs`, one version: the header) or of the token route
    (`logprobs.content[].logprob`, the versions from its `weight_versions` spans; "interrupted" when the server
    says a checkpoint cut it short)."""
    choice = data["choices"][0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        lps = [float(x["logprob"]) for x in logprobs["content"] or []]
    else:
        lps = [float(x) for x in logprobs.get("token_logprobs") or []]
    if len(lps) != len(ids):
        raise RemoteEngineError(f"rollout server {server}: {len(ids)} tokens but {len(lps)} logprobs")
    reason = choice.get("finish_reason") if choice.get("finish_reason") in ("stop", "length") else "abort"
    if reason == "abort" and headers.get(INTERRUPTED_HEADER) == "1":
        reason = "interrupted"  # its tokens so far are kept; the manager continues it from them
    spans = {"weight_versions": choice.get("weight_versions"), "weight_version": int(headers.get(VERSION_HEADER, -1))}
    return GenerationResponse(ids, lps, reason, token_versions(spans, len(ids)), served_by=server)


def token_versions(meta: dict, n: int) -> list:
    """The weight version of each of n output tokens: from the engine's spans `{version, start, end}` (vLLM's
    `WeightVersionSpan`s, SGLang's `meta_info.weight_versions`; a request that straddles an update carries several),
    else its one `weight_version` (an int as mgrpo labels it; -1 for an engine's own start label, "default")."""

    def as_int(v):
        try:
            return int(v)
        except (TypeError, ValueError):
            return -1

    spans = meta.get("weight_versions")
    if not spans:
        return [as_int(meta.get("weight_version"))] * n
    out = [-1] * n
    for span in spans:
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[i] = as_int(span["version"])
    return out


def run_identity(cfg) -> str:
    """rollout.remote.run_id, resolved in place (the checkpoint's config.yaml keeps it): as set, else the resumed
    checkpoint's, else a new random one."""
    r = cfg.rollout.remote
    if not r.run_id and cfg.checkpoint.resume:
        import yaml

        from mgrpo.checkpoint import resolve

        with open(os.path.join(resolve(cfg.checkpoint.resume, cfg.checkpoint.save_dir), "config.yaml")) as f:
            r.run_id = str((((yaml.safe_load(f) or {}).get("rollout") or {}).get("remote") or {}).get("run_id") or "")
    r.run_id = r.run_id or secrets.token_hex(8)
    return r.run_id


def engine_from_config(cls, cfg, tokenizer):
    """A RemoteEngine (or a dialect of it) from rollout.servers and rollout.remote."""
    r = cfg.rollout.remote
    servers = cfg.rollout.servers
    if isinstance(servers, str):
        servers = [s for s in servers.split(",") if s]
    started = time.time()
    engine = cls(
        servers,
        server_token(r.token_file),
        tokenizer.eos_token_id,
        connect_timeout_s=r.connect_timeout_s,
        request_timeout_s=r.request_timeout_s,
        max_inflight_per_server=r.max_inflight_per_server,
        retries=r.retries,
        backoff_s=r.backoff_s,
        update_timeout_s=r.update_timeout_s,
        ca_file=r.ca_file,
        checksum=r.checksum,
        max_consecutive_failures=r.max_consecutive_failures,
        run_id=run_identity(cfg),
        take_over=r.take_over,
        delta=r.delta,
        full_every=r.full_every,
        in_flight=in_flight_mode(cfg.rollout),
    )
    engine.log(
        f"rollout servers ({cls.name}): {', '.join(x.name for x in engine.replicas)} (weight version "
        f"{engine.version}, reached in {time.time() - started:.1f} s; trainer run {engine.run_id})"
    )
    return engine


@register_engine("remote")
def _make_remote(cfg, model_dir: str, tokenizer) -> RemoteEngine:
    return engine_from_config(RemoteEngine, cfg, tokenizer)
