"""The rollout server's routes for weight sync by collective broadcast (`--transport collective`; all guarded by the
token and by the run ownership of `ownership.py`):

    POST /mgrpo/collective/open               {"senders": S}: opens a TCPStore on --collective-host (nothing listens
                                              before this call), draws a one-time nonce, has every worker join one
                                              group per sender (in the background: they wait for the senders), and
                                              answers {host, port, nonce, workers, backend, timeout_s}
    POST /mgrpo/collective/{version}/update   {"delta_base": V | null, "keep_base": bool, "in_flight"} (`delta.py`):
                                              pause, receive every sender's buckets through vLLM's weight-transfer
                                              phases (`collective_receiver.py`: each bucket checked as it arrives,
                                              the set for completeness before anything loads), load, reset the
                                              prefix cache, stamp the version, resume; the same deadline and
                                              poisoning as the HTTP commit

A new open, a take-over by another run, or a broken broadcast tears the groups down; the trainer opens new ones.
Gloo and NCCL have no authentication: the nonce keeps strangers out of the rendezvous, not off the wire (README).
"""
# (no `from __future__ import annotations`: FastAPI reads the route signatures at runtime)

import asyncio
import datetime
import secrets
import time

from mgrpo.serving.weight_routes import UpdateFailed, UpdateState, apply_version, in_flight_of
from mgrpo.weights.transports.collective_group import version_mismatch, wire_versions

MAX_SENDERS = 4096


class CollectiveState:
    def __init__(self):
        self.store = self.nonce = self.joined = None
        self.senders = 0

    def drop(self) -> None:
        if self.joined is not None and not self.joined.done():
            self.joined.cancel()
        self.store = self.nonce = self.joined = None


def add_collective_routes(
    app,
    engine_client,
    gate,
    update: UpdateState,
    expected: dict,
    optional: list,
    update_timeout_s: float,
    host: str,
    backend: str,
    join_timeout_s: float,
    stream: bool = False,
) -> None:
    import torch.distributed as dist
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from mgrpo.serving.collective_receiver import POISONED

    state = CollectiveState()
    workers = engine_client.vllm_config.parallel_config.world_size

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    async def teardown() -> None:
        state.drop()
        try:
            await asyncio.wait_for(engine_client.collective_rpc("shutdown_weight_transfer_engine"), 30)
        except Exception:  # noqa: BLE001  (nothing open, or already broken: gone either way)
            pass

    update.on_new_owner.append(state.drop)  # the groups belong to the run that opened them

    @app.post("/mgrpo/collective/open")
    async def open_groups(request: Request):
        if int(request.headers.get("content-length") or 1 << 20) > 4096:
            return error(413, 'the open body is {"senders": N}')
        body = await request.json()
        senders = int(body.get("senders", 0))
        if not 1 <= senders <= MAX_SENDERS:
            return error(400, f"senders={senders}: one per trainer pipeline stage, 1..{MAX_SENDERS}")
        # a trainer sends its versions (and checks the server's in the answer); a client that sends none is
        # checked on its side only
        mismatch = body.get("versions") and version_mismatch(body["versions"], wire_versions(backend), backend)
        if mismatch:
            return error(409, mismatch)
        async with update.lock:
            why = update.refusal(None) or update.claim(None, request.headers)
            if why:
                return error(409, why)
            if update.committing is not None:
                return error(409, f"an update to version {update.committing} is in progress")
            await teardown()
            timeout = datetime.timedelta(seconds=join_timeout_s)
            state.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            state.nonce, state.senders = secrets.token_hex(16), senders
            info = dict(
                host=host,
                port=state.store.port,
                nonce=state.nonce,
                senders=senders,
                backend=backend,
                timeout_s=join_timeout_s,
                op_timeout_s=update_timeout_s,
            )
            state.joined = asyncio.ensure_future(
                engine_client.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
            )
        return dict(info, workers=workers, senders=senders, versions=wire_versions(backend))

    @app.post("/mgrpo/collective/{version}/update")
    async def collective_update(version: int, request: Request):
        if int(request.headers.get("content-length") or 0) > 4096:
            return error(413, 'the update body is {"delta_base": V or null, "keep_base": bool, "in_flight": mode}')
        body = (await request.json()) if int(request.headers.get("content-length") or 0) else {}
        delta = {"delta_base": body.get("delta_base"), "keep_base": bool(body.get("keep_base"))}
        if delta["delta_base"] is not None and not isinstance(delta["delta_base"], int):
            return error(400, f"delta_base={delta['delta_base']!r}: a weight version (int) or null")
        in_flight, bad = in_flight_of(body)
        if bad:
            return error(400, bad)
        async with update.lock:
            why = update.refusal(version) or update.claim(version, request.headers)
            if why:
                return error(409, why)
            if state.joined is None:
                return error(409, "no collective group is open: POST /mgrpo/collective/open first")
            result = await apply_version(
                gate,
                update,
                engine_client,
                version,
                update_timeout_s,
                lambda timeout: receive(version, timeout, delta),
                in_flight,
            )
            if isinstance(result, dict):
                update.owner.committed(version)
            else:
                await teardown()  # a failed broadcast leaves the groups unusable: the trainer opens new ones
            return result

    @app.post("/mgrpo/collective/probe")
    async def probe(request: Request):
        """Benchmarks: time `bytes` of plain broadcasts from sender 0 into one preallocated buffer (the wire's
        limit between these processes); nothing is loaded, the version stays."""
        body = await request.json()
        async with update.lock:
            why = update.refusal(None) or update.claim(None, request.headers)
            if why or state.joined is None:
                return error(409, why or "no collective group is open: POST /mgrpo/collective/open first")
            await asyncio.wait_for(asyncio.shield(state.joined), timeout=join_timeout_s)
            await phases(
                {"version": -1, "probe_bytes": int(body["bytes"]), "probe_bucket": int(body["bucket_bytes"])},
                update_timeout_s,
            )
            return (await engine_client.collective_rpc("mgrpo_collective_receipt"))[0]

    async def phases(update_info: dict, timeout: float) -> list:
        """vLLM's start / update / finish on every worker within `timeout`; the time each phase ended."""
        t0, marks = time.perf_counter(), []
        await engine_client.collective_rpc("start_weight_update")
        marks.append(time.perf_counter())
        for method, kwargs in (("update_weights", {"update_info": update_info}), ("finish_weight_update", None)):
            await asyncio.wait_for(
                engine_client.collective_rpc(method, kwargs=kwargs),
                timeout=max(timeout - (time.perf_counter() - t0), 0.001),
            )
            marks.append(time.perf_counter())
        return marks

    async def receive(version: int, timeout: float, delta: dict) -> dict:
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(state.joined), timeout=min(timeout, join_timeout_s))
        except Exception as exc:  # noqa: BLE001
            raise UpdateFailed(
                f"the trainer's senders did not join the groups within {join_timeout_s:g} s: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        start = time.perf_counter()
        try:
            marks = [start] + await phases(
                {"version": version, "expected": expected, "optional": optional, "stream": stream, **delta},
                max(timeout - (start - t0), 0.001),
            )
        except asyncio.TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise UpdateFailed(str(exc), poisoned=POISONED in str(exc)) from None
        receipts = await engine_client.collective_rpc("mgrpo_collective_receipt")
        errors = [r["error"] for r in receipts if r.get("error")]  # the workers report failures, never raise
        if errors:
            why = next((e for e in errors if POISONED in e), errors[0])
            raise UpdateFailed(why, poisoned=POISONED in why)
        split = {
            f"{name}_rpc_s": b - a for name, a, b in zip(("join", "start", "update", "finish"), [t0] + marks, marks)
        }
        return dict(receipts[0], transport="collective", backend=backend, **split)
