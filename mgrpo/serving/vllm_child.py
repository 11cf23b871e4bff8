"""The colocated vLLM engine process: one `AsyncLLM`, served over a local socket to the trainer rank that
started it (`mgrpo.rollout.engines.vllm`). Started as `python -m mgrpo.serving.vllm_child` with a JSON spec on
stdin; it dies with its parent (a watchdog kills its whole process group, vLLM's engine core included).

Requests (length-prefixed JSON, each with the engine's token): `generate`, `update` (pause, load through the
worker extension, reset the prefix cache, stamp the version, resume), `load_adapter` (LoRA adapter-only sync: pause,
add the version's PEFT folder as a new LoRARequest, drop the previous one, resume), `health`, `stats` (requests in
flight, counted here), `shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time

from mgrpo.models.routing import encode_routing

# on CPU, vLLM's idle busy-polling is shortened (vllm_worker._quiet_idle_spin), inherited by the engine core this
# process starts
from mgrpo.serving import vllm_worker  # noqa: F401
from mgrpo.serving.shm_receiver import worker_outcome
from mgrpo.serving.vllm_settings import (
    WORKER_EXTENSION,
    cpu_scheduling,
    hf_manifest,
    lora_engine_args,
    sleep_engine_args,
    until,
    until_held,
)
from mgrpo.weights import local_rpc
from mgrpo.weights.transports.buffers import SHM_DIR, buffer_prefix


def _die_with_parent(parent: int, spec: dict) -> None:
    """A trainer that crashes or is killed takes this process group (AsyncLLM's engine core too) with it, and
    what it could not clean up itself: the engine's private socket directory and its shared weight buffers."""

    def kill_group(*_):
        shutil.rmtree(os.path.dirname(spec["socket"]), ignore_errors=True)
        for path in glob.glob(os.path.join(SHM_DIR, f"{buffer_prefix(parent, spec['token'])}-*")):
            try:
                os.unlink(path)
            except OSError:
                pass
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        kill_group()

    signal.signal(signal.SIGTERM, kill_group)
    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


class EngineServer:
    def __init__(self, spec: dict):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.spec, self.token = spec, spec["token"]
        args = AsyncEngineArgs(
            **cpu_scheduling(spec),
            model=spec["model"],
            dtype=spec["dtype"],
            seed=spec["seed"],
            enforce_eager=spec["enforce_eager"],
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            skip_tokenizer_init=True,
            worker_extension_cls=WORKER_EXTENSION["colocated"],
            enable_prefix_caching=True,
            max_num_seqs=spec["max_num_seqs"],
            max_model_len=spec["max_model_len"],
            tensor_parallel_size=spec["tensor_parallel_size"],
            gpu_memory_utilization=spec["gpu_memory_utilization"],
            disable_log_stats=True,
            distributed_executor_backend="uni" if spec["tensor_parallel_size"] == 1 else None,
            # routing replay: each token's experts (vLLM's aux output; Model Runner V2, set in the child's env)
            enable_return_routed_experts=bool(spec.get("routed_experts")),
            **lora_engine_args(spec.get("lora_rank")),
            **sleep_engine_args(spec.get("sleep_level", 0)),
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.dtype = str(self.llm.vllm_config.model_config.dtype).replace("torch.", "")
        self.expected, self.optional = hf_manifest(spec["model"], self.dtype)
        self.version, self.poisoned = 0, None
        self.lora = None  # the LoRARequest every generation uses (adapter-only sync); None: the weights alone
        self.gate = asyncio.Condition()  # generation pauses here: updates wait for in-flight calls, new calls wait
        self.inflight, self.updating = 0, False  # for the update
        self.requests_inflight, self.requests_peak, self.requests_served = 0, 0, 0  # counted here, at the engine
        self.interrupts_begun, self.interrupts_done = 0, 0  # `interrupt` calls: a request alive during one ends so
        self.stop = asyncio.Event()
        self.asleep: set = set()  # vLLM's sleep tags now asleep: "weights", "kv_cache"
        self.phases: list = []  # the last sleep/wake/update calls, in order (health reports them)

    async def generate(self, requests: list, sampling: dict, eos: int | None) -> list:
        self.generate_calls = getattr(self, "generate_calls", 0) + 1
        if self.generate_calls == self.spec.get("die_on_generate"):  # test hook: the engine dies mid-request
            os.killpg(os.getpgid(0), signal.SIGKILL)
        async with self.gate:
            await self.gate.wait_for(lambda: not self.updating)
            self.inflight += 1
        try:
            return await self._generate(requests, sampling, eos)
        finally:
            async with self.gate:
                self.inflight -= 1
                self.gate.notify_all()

    async def _generate(self, requests: list, sampling: dict, eos: int | None) -> list:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.poisoned:
            raise RuntimeError(f"engine holds a half-applied weight update and will not serve: {self.poisoned}")
        if self.asleep:
            raise RuntimeError(f"engine is asleep ({', '.join(sorted(self.asleep))}): wake it before generating")
        version, lora = self.version, self.lora
        salt = {"cache_salt": f"v{version}"}  # no block computed under other weights is reused (update "keep")

        async def one(req):
            sp = SamplingParams(
                n=1,
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                top_k=sampling["top_k"],
                max_tokens=req.get("max_tokens") or sampling["max_tokens"],
                seed=req["seed"],
                logprobs=0,
                ignore_eos=sampling["ignore_eos"],
                detokenize=False,
                stop_token_ids=[eos] if eos is not None and not sampling["ignore_eos"] else None,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            rid = f"{req.get('request_id') or 'r'}-{secrets.token_hex(4)}"
            final, interrupts_before = None, self.interrupts_done
            self.requests_inflight += 1
            self.requests_peak = max(self.requests_peak, self.requests_inflight)
            try:
                async for out in self.llm.generate(
                    TokensPrompt(prompt_token_ids=req["prompt_ids"], **salt), sp, rid, lora_request=lora
                ):
                    final = out
            finally:
                self.requests_inflight -= 1
                self.requests_served += 1
            c = final.outputs[0]
            ids = list(c.token_ids)
            lps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
            if reason == "abort" and self.interrupts_begun > interrupts_before:  # alive during an `interrupt`
                reason = "interrupted"
            versions = token_versions(c.weight_versions, len(ids), version)
            out = {"token_ids": ids, "logprobs": lps, "finish_reason": reason, "weight_versions": versions}
            if getattr(c, "routed_experts", None) is not None:  # [tokens run, moe_layers, topk]
                n = len(req["prompt_ids"]) + len(ids) - 1
                out["routed_experts"] = encode_routing(c.routed_experts[:n])
            return out

        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def update(self, version: int, channel: str, reset_cache: bool = True, in_flight: str = "finish") -> dict:
        """Pause generation, load every bucket through the worker, reset the prefix cache (vLLM's reload does
        not: cached KV of the old weights would be reused), stamp the version in vLLM's engine core, resume.

        `in_flight` says what happens to requests already running (issue 56, partial rollout):
        - "finish": the calls in flight finish on the old weights first (this server is the engine's only
          client, so its gate is the pause); every response comes from one version.
        - "keep": vLLM's `pause_generation(mode="keep", clear_cache=False)` freezes them where they are; they
          continue on the new weights, attending over the KV cache their prefix got under the old ones (what
          verl's partial rollout and AReaL's interruptible generation do). Requests that start later get a
          cache salt of their version, so no new request reuses a block computed under other weights.
        - "recompute": the same pause with `clear_cache=True`: vLLM preempts the running requests and drops
          every cached block; on resume each one's prefix is prefilled again under the new weights, so every
          token after the update is exactly the new policy's (NeMo-RL's
          `recompute_kv_cache_after_weight_updates`), at the cost of one prefill per request in flight.
        Either way vLLM's engine core stamps each output with the version (`set_weight_version`), and every
        token's version comes back in the response (`CompletionOutput.weight_versions` spans)."""
        if in_flight not in ("finish", "keep", "recompute"):
            raise ValueError(f"in_flight={in_flight!r}: finish | keep | recompute")
        if "weights" in self.asleep:  # on a GPU the load would write into unmapped memory
            raise RuntimeError("the engine's weights are asleep: wake them (wake_up weights) before a push")
        t0, requests = time.perf_counter(), self.requests_inflight
        held = in_flight != "finish"  # requests in flight stay inside vLLM, frozen, through the load
        async with self._paused(wait_for_calls=not held):
            if held:
                await self.llm.pause_generation(mode="keep", clear_cache=in_flight == "recompute")
                reset_cache = False  # "recompute" cleared it; "keep" cannot while requests hold blocks: salted
            try:
                t1 = time.perf_counter()
                results = await self.llm.collective_rpc(
                    "mgrpo_receive_weights",
                    kwargs=dict(channel=channel, token=self.token, expected=self.expected, optional=self.optional),
                )
                t2 = time.perf_counter()
                error, poisoned = worker_outcome(results)
                if error:
                    self.poisoned = poisoned
                    raise RuntimeError(poisoned or error)
                if reset_cache and not await self.llm.reset_prefix_cache():
                    self.poisoned = "vLLM refused to reset the prefix cache after an update"
                    raise RuntimeError(self.poisoned)
                await self.llm.engine_core.set_weight_version_async(str(version))
                self.version = version
                self._phase("update")
            finally:
                if held:  # a half-applied update must not sample: its held requests end as aborted
                    if self.poisoned:
                        await self.llm.pause_generation(mode="abort", clear_cache=False)
                    await self.llm.resume_generation()
        return dict(
            results[0]["receipt"],
            version=version,
            load_s=max(r["load_s"] for r in results),
            streamed=results[0]["streamed"],
            staged_at=results[0]["staged_at"],
            pause_s=t1 - t0,
            rpc_s=t2 - t1,
            reset_s=time.perf_counter() - t2,
            total_s=time.perf_counter() - t0,
            held_requests=requests if held else 0,  # continued on the new weights (partial rollout)
        )

    async def interrupt(self, expect: int = 0) -> dict:
        """End every request in flight now, with the tokens it has, as "interrupted" (a checkpoint of a partial
        run stores them and the run continues each from its prefix: `RolloutProducer.settle`). vLLM's
        `pause_generation(mode="abort")` returns each aborted request's tokens, logprobs and version spans so
        far; generation resumes at once. New calls wait at the gate meanwhile."""
        t0 = time.perf_counter()
        await until(lambda: self.requests_inflight >= expect)  # the calls its client sent are here
        async with self._paused(wait_for_calls=False):
            self.interrupts_begun += 1
            try:
                requests, missed = await until_held(self.llm, lambda: self.requests_inflight, expect)
                await self.llm.pause_generation(mode="abort", clear_cache=False)
            finally:
                await self.llm.resume_generation()
                self.interrupts_done += 1
        return {"interrupted_requests": requests, "not_yet_generating": missed, "total_s": time.perf_counter() - t0}

    async def sleep(self, level: int) -> dict:
        """The rollout phase is over: the engine's device memory goes to the trainer (level 1: weights to host
        memory, KV cache dropped; level 2: both dropped, every weight comes back with the next full push). Calls in
        flight finish first. On CPU vLLM's worker logs a no-op; the states and their order are kept all the same."""
        t0 = time.perf_counter()
        async with self._paused():
            await self.llm.sleep(level)
            self.asleep = {"weights", "kv_cache"}
            self._phase(f"sleep{level}")
        return {"asleep": sorted(self.asleep), "total_s": time.perf_counter() - t0}

    async def wake_up(self, tags: list) -> dict:
        """Wake the named parts, each by its own call (vLLM's wake_up wakes nothing when any tag named is awake)."""
        t0 = time.perf_counter()
        for tag in tags:
            if tag not in ("weights", "kv_cache"):
                raise ValueError(f"unknown sleep tag {tag!r}: weights | kv_cache")
            if tag in self.asleep:
                await self.llm.wake_up(tags=[tag])
                self.asleep.discard(tag)
                self._phase(f"wake_{tag}")
        return {"asleep": sorted(self.asleep), "total_s": time.perf_counter() - t0}

    def _phase(self, name: str) -> None:
        """Kept for `health` and logged (its order is what the trainer's turns promise: sleep, wake the weights,
        update, wake the KV cache)."""
        self.phases = (self.phases + [name])[-64:]
        print(f"mgrpo engine phase: {name} (version {self.version})", flush=True)

    @contextlib.asynccontextmanager
    async def _paused(self, wait_for_calls: bool = True):
        """New calls wait for as long as an update runs; with `wait_for_calls` the calls in flight finish first
        (without it, vLLM's own pause holds their requests: `update`)."""
        if self.poisoned:
            raise RuntimeError(f"engine is poisoned by an earlier update: {self.poisoned}")
        async with self.gate:
            await self.gate.wait_for(lambda: not self.updating)
            self.updating = True
            if wait_for_calls:
                await self.gate.wait_for(lambda: self.inflight == 0)
        try:
            yield
        finally:
            async with self.gate:
                self.updating = False
                self.gate.notify_all()

    async def load_adapter(self, version: int, path: str) -> dict:
        """LoRA adapter-only sync: the version's PEFT folder becomes the LoRARequest of every later generation.
        A new name and id per version: vLLM keys prefix-cache blocks by the adapter's name and path, so no cached KV
        of the previous adapter is reused (no reset needed); the previous adapter is then dropped."""
        from vllm.lora.request import LoRARequest

        if self.spec.get("lora_rank") is None:
            raise RuntimeError("this engine was started without LoRA (rollout.lora_sync is not adapter)")
        t0 = time.perf_counter()
        async with self._paused():
            request = LoRARequest(f"mgrpo-v{version}", version, path)
            if not await self.llm.add_lora(request):
                raise RuntimeError(f"vLLM refused the adapter of version {version} at {path}")
            await self.llm.engine_core.set_weight_version_async(str(version))  # every token's label (update)
            previous, self.lora, self.version = self.lora, request, version
            if previous is not None and previous.lora_int_id != version:
                await self.llm.remove_lora(previous.lora_int_id)
        return {"version": version, "total_s": time.perf_counter() - t0}

    def stats(self, reset: bool = False) -> dict:
        """Requests inside vLLM now, the most at once (since start or the last reset), and served in total."""
        out = {
            "requests_inflight": self.requests_inflight,
            "requests_peak": self.requests_peak,
            "requests_served": self.requests_served,
        }
        if reset:
            self.requests_peak = self.requests_inflight
        return out

    async def handle(self, reader, writer) -> None:
        try:
            msg = await local_rpc.async_recv(reader)
            if not secrets.compare_digest(str(msg.get("token", "")), self.token):
                await local_rpc.async_send(writer, {"ok": False, "error": "bad token"})
                return
            op = msg.get("op")
            try:
                if op == "generate":
                    result = await self.generate(msg["requests"], msg["sampling"], msg.get("eos"))
                elif op == "update":
                    result = await self.update(
                        msg["version"], msg["channel"], msg.get("reset_cache", True), msg.get("in_flight", "finish")
                    )
                elif op == "interrupt":
                    result = await self.interrupt(int(msg.get("expect", 0)))
                elif op == "sleep":
                    result = await self.sleep(int(msg["level"]))
                elif op == "wake_up":
                    result = await self.wake_up(list(msg["tags"]))
                elif op == "load_adapter":
                    result = await self.load_adapter(int(msg["version"]), str(msg["folder"]))
                elif op == "health":
                    result = {
                        "ok": self.poisoned is None,
                        "version": self.version,
                        "pid": os.getpid(),
                        "dtype": self.dtype,
                        "poisoned": self.poisoned,
                        "asleep": sorted(self.asleep),
                        "phases": self.phases,
                    }
                elif op == "stats":
                    result = self.stats(bool(msg.get("reset")))
                elif op == "shutdown":
                    self.stop.set()
                    result = {"stopping": True}
                else:
                    raise ValueError(f"unknown op {op!r}")
                reply = {"ok": True, "result": result}
            except Exception as exc:  # noqa: BLE001  (the caller gets the message; the server keeps serving)
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            await local_rpc.async_send(writer, reply)
        except (local_rpc.RpcError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve(self) -> None:
        await self.llm.engine_core.set_weight_version_async(str(self.version))  # vLLM's own label: "default"
        server = await asyncio.start_unix_server(self.handle, path=self.spec["socket"], limit=local_rpc.MAX_MESSAGE)
        os.chmod(self.spec["socket"], 0o600)
        async with server:
            await self.stop.wait()
        self.llm.shutdown()


def token_versions(spans, n: int, version: int) -> list:
    """Each output token's weight version, from vLLM's `WeightVersionSpan`s (`[start, end)` sampled by weights
    labelled `version`), or `version` for all when vLLM reported none."""
    if not spans:
        return [version] * n
    out = [version] * n
    for span in spans:
        try:
            label = int(span.version)
        except ValueError:  # vLLM's own "default": a token sampled before this server labelled any version
            label = -1
        out[span.start : span.end] = [label] * (span.end - span.start)
    return out


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    _die_with_parent(spec["parent_pid"], spec)

    async def run():
        await EngineServer(spec).serve()

    asyncio.run(run())
    os._exit(0)  # vLLM's threads must not keep the process alive after shutdown


if __name__ == "__main__":
    main()
