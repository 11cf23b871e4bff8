"""Prompts in, `Sample`s out, over one or several engines.

Placement (`rollout.engine_placement`): `rank0`, one engine on global rank 0, or `per_dp`, one engine on the
first rank of each data-parallel replica (its export destination). A step's prompts are split into contiguous
shares, one per engine, so a prompt's n samples stay on one engine. Each engine owner runs its share in calls of
at most `rollout.max_inflight` requests (concurrently only for async engines), each under
`rollout.request_timeout_s` (it bites on engines that wait on something: child processes, servers; the in-process
HF engine computes inline and cannot hang on I/O); then every rank receives every sample as JSON bytes (one
broadcast per engine owner), or the first error, so all ranks fail the step together with one line naming the
engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from mgrpo.data.dataset import encode_prompt
from mgrpo.parallel.device import cpu_group, share_json
from mgrpo.rollout.engine import request_seed
from mgrpo.rollout.multiturn.driver import fail_aborted
from mgrpo.rollout.types import GenerationRequest, Sample, SamplingParams, sample_dict
from mgrpo.stopping import within
from mgrpo.weights.sync import Export, NoEngine, WeightSync


class RolloutError(RuntimeError):
    """A step's rollout failed (an engine timed out or raised); the message names the engine."""


def engine_owners(placement: str) -> dict:
    """{dp_rank: global rank} of every engine (also the export destinations)."""
    from megatron.core import parallel_state as mpu

    mine = torch.tensor(
        [
            mpu.get_data_parallel_rank(),
            int(
                mpu.get_pipeline_model_parallel_rank() == 0
                and mpu.get_tensor_model_parallel_rank() == 0
                and mpu.get_context_parallel_rank() == 0
            ),
        ]
    )
    table = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine, group=cpu_group())
    leaders = {int(t[0]): r for r, t in enumerate(table) if int(t[1])}
    return {0: 0} if placement == "rank0" else dict(sorted(leaders.items()))


def owner_index(owners: dict) -> int | None:
    """This rank's position among the engine owners (its engine's index), or None if it owns no engine."""
    ranks = list(owners.values())
    return ranks.index(dist.get_rank()) if dist.get_rank() in ranks else None


def shares(n_prompts: int, n_engines: int) -> list:
    """Contiguous prompt ranges, one per engine, sizes differing by at most one."""
    base, extra = divmod(n_prompts, n_engines)
    out, start = [], 0
    for k in range(n_engines):
        size = base + (k < extra)
        out.append(range(start, start + size))
        start += size
    return out


class RolloutManager:
    def __init__(self, cfg, tokenizer, owners: dict, engine=None, engine_index: int = 0):
        self.cfg, self.tokenizer, self.engine, self.index = cfg, tokenizer, engine, engine_index
        self.owners = list(owners.values())
        self.asked: dict = {}  # (step, round, tag) -> (rows, sampling, n) of a share in flight (owners): a reissue
        self.faults = {"engines_up": len(self.owners), "reissued_requests": 0, "engine_restarts": 0}
        self.settling = False  # a checkpoint interrupts the batches in flight: no trajectory starts a new turn

    def fault_metrics(self) -> dict:
        """rollout/engines_up (engines that served the last share), rollout/reissued_requests (since the last call),
        rollout/engine_restarts (in the run): the same on every rank."""
        out = {f"rollout/{k}": v for k, v in self.faults.items()}
        self.faults["reissued_requests"] = 0
        return out

    def sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos
        )

    def requests_for(self, rows: list, step: int, prompt_indices, n: int, first: int = 0, tag: str = "") -> list:
        """n requests per prompt, seeded per sample by (step, prompt index first + i, sample index)."""
        seed = self.cfg.train.seed + (7919 if tag else 0)  # validation draws its own streams
        return [
            GenerationRequest(
                prompt_ids(self.tokenizer, rows[i], self.cfg.data.apply_chat_template),
                request_seed(seed, step, first + i, j),
                f"{tag}{step}-{first + i}-{j}",
                rows[i].get("max_tokens"),  # the row's own limit, checked at load (data/dataset.py)
            )
            for i in prompt_indices
            for j in range(n)
        ]

    async def _run(self, requests: list, sampling: SamplingParams) -> list:
        chunk, timeout = self.cfg.rollout.max_inflight, self.cfg.rollout.request_timeout_s
        parts = [requests[i : i + chunk] for i in range(0, len(requests), chunk)]

        async def one(part):
            try:
                return await within(self.engine.generate(part, sampling), timeout)
            except asyncio.TimeoutError:
                raise RolloutError(
                    f"engine {self.engine.name} did not answer {len(part)} requests within "
                    f"rollout.request_timeout_s={timeout:g} s"
                ) from None

        if self.engine.capabilities.async_generate:
            results = await asyncio.gather(*(one(p) for p in parts))
        else:
            results = [await one(p) for p in parts]
        return [resp for part in results for resp in part]

    def scheduler(self):
        """`rollout.scheduler`, made once per engine owner (it may hold state across trajectories)."""
        if getattr(self, "_scheduler", None) is None:
            from mgrpo.rollout.multiturn.driver import context_limit
            from mgrpo.rollout.multiturn.registry import make_rollout_scheduler

            self._scheduler = make_rollout_scheduler(self.cfg, self.tokenizer, context_limit(self.cfg))
        return self._scheduler

    def score_options(self):
        from mgrpo.rewards.registry import ScoreOptions, response_token_budget

        r = self.cfg.reward
        return ScoreOptions(
            r.timeout_s, r.workers, tuple(self.cfg.external_plugins), response_token_budget(self.cfg.rollout)
        )

    def rounds_per_step(self) -> int:
        a = self.cfg.algorithm
        return 1 + (a.max_resample_times if a.dynamic_sampling else 0)

    def generate_share(
        self,
        rows: list,
        step: int,
        round_: int = 0,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        tag: str = "",
        indices=None,
    ) -> list:
        """This engine's share of `rows` as Samples, n per prompt (`indices`: these prompts instead, a reissue).
        Round r of a step (dynamic sampling draws several) numbers its prompts from r x len(rows): group ids and
        sampling seeds never repeat, and a reissued prompt keeps its seeds."""
        mine = shares(len(rows), len(self.owners))[self.index] if indices is None else list(indices)
        n = n or self.cfg.rollout.n
        first = round_ * len(rows)
        first_group = step * self.rounds_per_step() * len(rows) + first
        requests = self.requests_for(rows, step, mine, n, first=first, tag=tag)
        if self.cfg.rollout.scheduler:  # one trajectory per request, several engine calls each
            from mgrpo.rollout.multiturn.driver import scheduled_share

            prompt_of = [mine[k // n] for k in range(len(requests))]
            return scheduled_share(
                self.scheduler(),
                self.engine,
                self.cfg,
                requests,
                [rows[i] for i in prompt_of],
                [first_group + i for i in prompt_of],
                sampling or self.sampling(),
                stopping=self._stop if self.cfg.rollout.partial else None,  # only partial runs are interrupted
            )
        responses = asyncio.run(self._run(requests, sampling or self.sampling()))
        samples = []
        for k, (req, resp) in enumerate(zip(requests, responses)):
            i = mine[k // n]
            extra = {key: v for key, v in rows[i].items() if key not in ("messages", "prompt_ids")}
            samples.append(
                Sample(
                    prompt_ids=list(req.prompt_ids),
                    response_ids=list(resp.token_ids),
                    loss_mask=[1] * len(resp.token_ids),
                    rollout_logprobs=list(resp.logprobs),
                    group_id=first_group + i,
                    weight_version=min(resp.weight_versions, default=0),
                    token_versions=list(resp.weight_versions),
                    finish_reason=resp.finish_reason,
                    messages=rows[i]["messages"],
                    info=dict(extra, engine=resp.served_by or self.engine.name),
                    routed_experts=resp.routed_experts,
                )
            )
        return samples

    def rollout(
        self,
        rows: list,
        step: int,
        round_: int = 0,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        tag: str = "",
    ) -> list:
        """Each engine owner generates and scores its share of `rows`; every rank gets every sample, sorted by
        group (or every rank raises the first owner's error)."""
        return self.share(self.generate_local(rows, step, round_, sampling, n, tag))

    def generate_local(
        self,
        rows: list,
        step: int,
        round_: int = 0,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        tag: str = "",
    ) -> dict:
        """This owner's share of `rows`, generated and scored, as a JSON-safe payload (no collective: a background
        producer may run it; ranks without an engine return an empty one)."""
        if self.engine is None:
            return {"samples": []}
        key = [step, round_, tag]
        self.asked[tuple(key)] = (rows, sampling, n)
        mine = shares(len(rows), len(self.owners))[self.index]
        if getattr(self.engine, "awaiting_push", False):  # restarted: it holds the model folder's weights
            line = f"engine {self.engine.name} waits for a weight push after its restart"
            return {"down": line, "key": key, "indices": list(mine), "samples": []}
        try:
            return {"samples": self._scored(rows, step, round_, sampling, n, tag), "key": key}
        except Exception as exc:  # noqa: BLE001  (every rank must reach share(), then fail together)
            error = f"step {step}: {type(exc).__name__}: {exc}"
            if getattr(self.engine, "alive", lambda: True)():
                return {"error": error, "key": key}
            return self._engine_died(error, key, mine)

    def continue_local(self, samples: list, step: int) -> dict:
        """This owner's groups of a batch whose responses a checkpoint interrupted (`finish_reason` "interrupted",
        `RolloutProducer.settle`): each continued from its prefix (prompt + its tokens so far as the prompt, the
        rest of its token budget, a seed of its own), its tokens, logprobs and versions appended, then scored
        again. The prefix is never generated twice. A JSON-safe payload for `share`, like `generate_local`."""
        if self.engine is None:
            return {"samples": []}
        groups = sorted({s.group_id for s in samples})
        mine = {groups[i] for i in shares(len(groups), len(self.owners))[self.index]}
        own = [replace(s, info=dict(s.info)) for s in samples if s.group_id in mine]  # the caller's stay as they are
        todo = [s for s in own if s.finish_reason == "interrupted"]
        if self.cfg.rollout.scheduler:  # trajectories: replayed turn by turn, the interrupted turn continued
            from mgrpo.rollout.multiturn.driver import continue_scheduled

            try:
                own = continue_scheduled(self.scheduler(), self.engine, self.cfg, own, self.sampling(), self._stop)
                self._score([s for s in own if "continued_from" in s.info])
            except Exception as exc:  # noqa: BLE001  (every rank must reach share(), then fail together)
                return {"error": f"step {step}: continuing {len(todo)} interrupted trajectories: {exc}"}
            return {"samples": [sample_dict(s) for s in own]}
        budget = [(s.info.get("max_tokens") or self.cfg.rollout.max_tokens) - len(s.response_ids) for s in todo]
        requests = [
            GenerationRequest(
                list(s.prompt_ids) + list(s.response_ids),
                request_seed(self.cfg.train.seed + 104729, step, s.group_id, k),  # its own stream, not the prefix's
                f"continue{step}-{s.group_id}-{k}",
                left,
            )
            for k, (s, left) in enumerate(zip(todo, budget))
            if left > 0
        ]
        try:
            responses = iter(asyncio.run(self._run(requests, self.sampling())))
            for s, left in zip(todo, budget):
                if left <= 0:  # interrupted at its last token
                    s.finish_reason = "length"
                    continue
                resp = next(responses)
                prefix = len(s.response_ids)
                s.token_versions = (s.token_versions or [s.weight_version] * prefix) + list(resp.weight_versions)
                s.response_ids = s.response_ids + list(resp.token_ids)
                s.loss_mask = s.loss_mask + [1] * len(resp.token_ids)
                s.rollout_logprobs = (s.rollout_logprobs or []) + list(resp.logprobs)
                s.weight_version, s.finish_reason = min(s.token_versions), resp.finish_reason
                s.routed_experts = resp.routed_experts  # its prompt held the prefix: routing of the whole sequence
                s.info["continued_from"] = prefix
            self._score(todo)
        except Exception as exc:  # noqa: BLE001  (every rank must reach share(), then fail together)
            return {"error": f"step {step}: continuing {len(todo)} interrupted responses: {type(exc).__name__}: {exc}"}
        return {"samples": [sample_dict(s) for s in own]}

    def _stop(self) -> bool:
        return self.settling

    def _engine_died(self, error: str, key: list, indices) -> dict:
        """This owner's engine process is gone: restart it (it serves again only after the next full weight push:
        until then it holds the model folder's weights) and hand its share to the engines that are up."""
        line = f"engine {self.engine.name} died ({error}); its {len(indices)} prompts go to the engines that are up"
        print(f"mgrpo: warning: {line}", flush=True)
        try:
            started = time.perf_counter()
            self.engine.restart()
            print(f"mgrpo: engine {self.engine.name} restarted in {time.perf_counter() - started:.1f} s", flush=True)
        except Exception as exc:  # noqa: BLE001  (the step goes on without it; the next share fails on this rank)
            print(f"mgrpo: warning: engine {self.engine.name} did not restart: {type(exc).__name__}: {exc}", flush=True)
        return {"down": line, "key": key, "indices": list(indices), "samples": [], "restarted": True}

    def share(self, payload: dict) -> list:
        """Every owner's payload to every rank (a collective): all samples sorted by group, or the first error. An
        owner whose engine died: its prompts are generated again, with their own seeds, by the engines that are
        up (a second collective); every engine down fails the step in one line."""
        gathered = share_json(payload, self.owners)
        errors = [p["error"] for p in gathered if "error" in p]
        if errors:
            raise RolloutError(errors[0])
        down = [k for k, p in enumerate(gathered) if "down" in p]
        self.faults["engines_up"] = len(gathered) - len(down)
        if down:
            self.faults["engine_restarts"] += sum(bool(gathered[k].get("restarted")) for k in down)
            if len(down) == len(gathered):
                raise RolloutError(f"every rollout engine is down: {'; '.join(gathered[k]['down'] for k in down)}")
            gathered = [p for p in gathered if "down" not in p] + self._reissue(gathered, down)
        self.asked.pop(tuple(payload.get("key", ())), None)
        return sorted((Sample(**d) for p in gathered for d in p["samples"]), key=lambda s: s.group_id)

    def _scored(self, rows, step, round_, sampling, n, tag, indices=None) -> list:
        """This engine's samples of `rows` (its share, or `indices`), scored, as JSON-safe dicts."""

        samples = self._score(self.generate_share(rows, step, round_, sampling, n, tag, indices))
        return [sample_dict(s) for s in samples]

    def _score(self, samples: list) -> list:
        """The rewards of `samples`, in place; trajectories that raised train nothing."""
        from mgrpo.rewards.registry import score

        r = self.cfg.reward
        score(samples, self.tokenizer, r.funcs, r.weights, r.kwargs, self.score_options())
        fail_aborted(samples)
        return samples

    def _reissue(self, gathered: list, down: list) -> list:
        """The prompts of the engines that died, split over the engines that are up, generated and shared."""
        failed = sorted(i for k in down for i in gathered[k]["indices"])
        up = [k for k in range(len(gathered)) if k not in down]
        key = tuple(gathered[down[0]]["key"])
        payload = {"samples": []}
        if self.index in up and self.engine is not None:
            mine = [failed[i] for i in shares(len(failed), len(up))[up.index(self.index)]]
            rows, sampling, n = self.asked[key]
            try:
                payload = {"samples": self._scored(rows, key[0], key[1], sampling, n, key[2], indices=mine)}
            except Exception as exc:  # noqa: BLE001
                payload = {"error": f"step {key[0]}: reissued prompts: {type(exc).__name__}: {exc}"}
        again = share_json(payload, self.owners)
        errors = [p["error"] for p in again if "error" in p]
        if errors:
            raise RolloutError(errors[0])
        self.faults["reissued_requests"] += sum(len(p["samples"]) for p in again)
        return again


def prompt_ids(tokenizer, row: dict, apply_chat_template: bool = True) -> list:
    """The row's tokenized prompt (tokenized once at load), or encoded now for rows built in code."""
    ids = row.get("prompt_ids")
    return list(ids) if ids is not None else encode_prompt(tokenizer, row["messages"], apply_chat_template)


def fail_together(error: str | None, owners: list) -> None:
    """Every rank learns whether any engine owner failed (one small broadcast per owner) and raises the first
    owner's message: a failed engine start or weight update stops all ranks with one line, instead of leaving
    the others blocked in their next collective."""
    errors = [p["error"] for p in share_json({"error": error} if error else {}, owners) if "error" in p]
    if errors:
        raise RolloutError(errors[0])


def engine_gpus(cfg, owners: dict) -> tuple:
    """(physical GPUs per engine, each engine's host), the same on every rank: a colocated vLLM engine gets the
    GPUs of the trainer ranks it serves (`rollout/placement.py`); empty lists on CPU or for other engines."""
    from megatron.core import parallel_state as mpu

    from mgrpo.rollout.placement import RankDevice, engine_devices, engine_groups, my_device

    if cfg.rollout.engine != "vllm" or not torch.cuda.is_available():  # nothing to place: no gather at start
        return [[] for _ in owners], []
    me = my_device(device_count=torch.cuda.device_count())
    table = share_json([me.host, me.device, mpu.get_data_parallel_rank()], list(range(dist.get_world_size())))
    ranks = [RankDevice(host, device) for host, device, _ in table]
    hosts = [ranks[o].host for o in owners.values()]
    groups = engine_groups(cfg.rollout.engine_placement, [dp for _, _, dp in table], owners)
    return engine_devices(ranks, groups, cfg.rollout.vllm.tensor_parallel_size), hosts


def start_engine(cfg, tokenizer, owners: dict):
    """This rank's engine (None where it owns none), started on every owner; all ranks fail together. Rank 0
    prints which engine holds which GPUs."""
    from mgrpo.rollout.engine import check_capabilities, make_engine
    from mgrpo.rollout.placement import PlacementError, describe

    rank, index, engine, error = dist.get_rank(), owner_index(owners), None, None
    try:
        devices, hosts = engine_gpus(cfg, owners)
    except PlacementError as exc:  # computed alike on every rank from the same table
        raise RolloutError(str(exc)) from None
    if rank == 0 and any(devices):
        print(describe(devices, hosts, cfg.rollout.engine), flush=True)
    if index is not None:
        try:
            engine = make_engine(cfg, cfg.model.path, tokenizer, index, devices=devices[index])
            check_capabilities(engine, cfg)
        except Exception as exc:  # noqa: BLE001  (reported on every rank below)
            error = f"rank {rank}: the {cfg.rollout.engine} engine did not start: {type(exc).__name__}: {exc}"
    fail_together(error, list(owners.values()))
    from mgrpo.rollout.engine import truncation_warning

    if rank == 0 and truncation_warning(cfg):
        print(truncation_warning(cfg), flush=True)
    return engine


def needs_initial_weights(cfg) -> bool:
    """Remote servers were started on their own and may hold any weights: push the trainer's before step 0."""
    return cfg.rollout.engine in ("remote", "sglang")


def make_weight_sync(cfg, engine) -> WeightSync:
    """This rank's `WeightSync`: the engine's own transport on the ranks that own an engine (`NoEngine` on the
    others: they drive their share of the export); for collective broadcast (remote `transport: collective`,
    SGLang) one on every rank, each pipeline stage sending its own weights."""
    bucket_bytes, remote = cfg.rollout.update_bucket_mb << 20, cfg.rollout.remote
    if adapter_sync(cfg):
        from mgrpo.models.lora import peft_config
        from mgrpo.weights.transports.lora_adapter import AdapterTransport

        return (
            AdapterTransport(engine, peft_config(cfg.model.lora, cfg.model.path)) if engine is not None else NoEngine()
        )
    if cfg.rollout.engine == "sglang":
        from mgrpo.weights.transports.collective_sglang import SGLangCollectiveTransport

        return SGLangCollectiveTransport(
            engine, bucket_bytes, bind=remote.collective_bind, timeout_s=remote.update_timeout_s, ca_file=remote.ca_file
        )
    if cfg.rollout.engine == "remote" and cfg.rollout.remote.transport == "collective":
        from mgrpo.weights.transports.collective import CollectiveTransport

        return CollectiveTransport(
            engine,
            bucket_bytes,
            bind=remote.collective_bind,
            timeout_s=remote.update_timeout_s,
            delta=remote.delta,
            full_every=remote.full_every,
        )
    return engine.weight_transport(bucket_bytes) if engine is not None else NoEngine()


def adapter_sync(cfg) -> bool:
    """LoRA adapter-only sync (rollout.lora_sync: adapter): the engines get the adapters, not merged weights."""
    return cfg.model.lora.rank > 0 and cfg.rollout.lora_sync == "adapter"


def push_weights(
    sync: WeightSync, model_chunks: list, version: int, owners: dict, bucket_bytes: int, adapter_only: bool = False
) -> dict:
    """One weight version through this rank's `WeightSync` (every rank calls it: the export is a collective); then
    all ranks fail together if any engine rejected it (the rejecting engine still serves its old version).
    `adapter_only`: the export streams LoRA factors (PEFT names), not merged weights. Returns the sync/ metrics:
    `sync/bytes`, the HF tensor bytes streamed to this rank (None where the transport streams none: per-stage
    senders), and with deltas (rollout.remote.delta) `sync/wire_bytes`, `sync/delta_changed` (fraction of the
    elements that changed) and `sync/full_fallbacks` (servers that needed the whole version); from vLLM
    engines `sync/held_requests` (requests a partial push continued) and `sync/generation_paused_s`."""
    export, error, receipt = Export(model_chunks, owners, bucket_bytes, adapter_only), None, None
    try:
        receipt = sync.push(export, version)
    except Exception as exc:  # noqa: BLE001
        error = f"rank {dist.get_rank()}: weight version {version} not applied: {type(exc).__name__}: {exc}"
    fail_together(error, list(owners.values()))
    out = {"sync/bytes": export.bytes}
    delta = (receipt or {}).get("delta") if isinstance(receipt, dict) else None
    if delta:
        out["sync/wire_bytes"] = receipt.get("bytes")
        out["sync/delta_changed"] = delta["changed"] / max(delta["elements"], 1)
        out["sync/full_fallbacks"] = len(delta["full_fallback"])
    if isinstance(receipt, dict) and "held_requests" in receipt:  # vLLM engines: what the push paused
        out["sync/held_requests"] = receipt["held_requests"]  # continued on the new weights (rollout.partial)
        out["sync/generation_paused_s"] = receipt.get("generation_paused_s", receipt.get("total_s", 0.0))
    return out
