"""Runs a scheduler's trajectories concurrently against one engine and turns their outputs into `Sample`s.

`TurnClient` is the scheduler's `infer_engine`: each trajectory asks for one turn at a time. For an engine that
computes inline (HF) the client coalesces the turns that are ready at the same moment into one batched call; an
async engine (vLLM) gets one call per turn and batches them continuously itself. At most `rollout.max_concurrent` trajectories run at once, so at most that many
requests are ever at the engine. A trajectory that raises is reported, counted and kept out of training (its
sample carries `info["trajectory_error"]` and gets a NaN reward); the step goes on unless every one failed.

A checkpoint of a partial run (issue 56) interrupts trajectories too: the turn in flight ends with the tokens it has
and the trajectory stops (`TurnInterrupted`), and so does every trajectory that asks for a turn while the save
settles. Its sample is "interrupted" and keeps every turn so far in `info["resume"]` (JSON). A scheduler's own
state (environments, tools) is not saved: `continue_scheduled` runs the scheduler again from the start and answers
each turn it asks for from the record, as long as it asks with the same token context (a deterministic
environment does), continues the interrupted turn from its prefix, and generates from there on. A turn asked with
another context ends the replay: from it on, the trajectory is generated afresh (counted in
`info["replay_mismatch"]`). No recorded turn is generated twice.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import math
import os
from array import array
from dataclasses import astuple

from mgrpo.rollout.multiturn.tokens import turn_seed
from mgrpo.rollout.multiturn.types import ChatMessage, ChatResponse, InferRequest, ResponseChoice, flatten
from mgrpo.rollout.types import GenerationRequest, GenerationResponse, Sample
from mgrpo.stopping import within

log = logging.getLogger("mgrpo.rollout.multiturn")


class AllTrajectoriesFailed(RuntimeError):
    """Every trajectory of a rollout raised; the message has the first error."""


def context_digest(ids: list) -> str:
    """A turn's token context, as a recorded turn keeps it: a replay compares contexts, and the whole context of
    every turn (O(turns x length)) would otherwise sit in memory and in the checkpoint."""
    return f"{len(ids)}:" + hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


class TurnInterrupted(BaseException):
    """A checkpoint interrupted this trajectory (partial rollout). A BaseException, as asyncio's CancelledError:
    a scheduler's `except Exception` around its turns must not swallow it."""


class TurnClient:
    """Per-trajectory turns in, batched engine calls out, each under `timeout` seconds."""

    def __init__(self, engine, tokenizer, timeout: float, coalesce: bool | None = None, stopping=None, replay=None):
        """coalesce None: only for engines that compute inline (HF): there one batched forward beats many
        small ones (4.4x, benchmarks/multi_turn.py). An async engine (vLLM) batches continuously by itself, and
        a shared call would hold every turn until its slowest one finished (one call per turn is 1.4x faster).
        `stopping()`: true while a checkpoint settles (no new turn starts); `replay`: {uuid: recorded turns} of
        interrupted trajectories, answered without the engine."""
        self.engine, self.tokenizer, self.timeout = engine, tokenizer, timeout
        self.coalesce = (not engine.capabilities.async_generate) if coalesce is None else coalesce
        self.pending, self.flushing, self.calls = [], False, 0
        self.turns: dict = {}  # uuid -> [(input ids, generated ids, routed experts)] of MoE engines that report them
        self.stopping, self.replay = stopping or (lambda: False), dict(replay or {})
        # uuid -> every turn so far, JSON-safe (an interrupted trajectory's resume state); only where a save can
        # interrupt (`stopping` given: partial rollout), so other runs pay nothing per turn
        self.record: dict | None = {} if stopping is not None else None
        self.mismatched: set = set()  # uuids whose scheduler asked a replayed turn with another context

    async def infer_async(self, infer_request: InferRequest, sampling) -> ChatResponse:
        """One turn from `infer_request.prompt_ids`, seeded by (the trajectory's seed, its turn number). The
        engine's routed experts (MoE) are kept per trajectory, whatever the scheduler does with the turn."""
        infer_request.turns_generated += 1
        k, uuid = infer_request.turns_generated, infer_request.uuid
        req = GenerationRequest(list(infer_request.prompt_ids), turn_seed(infer_request.seed, k), f"{uuid}-t{k}")
        saved = self.replay.get(uuid) or []
        resp, context = None, context_digest(req.prompt_ids) if self.record is not None else None
        if len(saved) >= k and saved[k - 1]["context"] == context:
            resp = await self._replayed(saved[k - 1], req, sampling, k)
        elif len(saved) >= k:  # the scheduler asked with another context: generated afresh from here
            self.replay.pop(uuid)
            self.mismatched.add(uuid)
        if resp is None:
            if self.stopping():
                raise TurnInterrupted(f"{uuid}: a checkpoint settles; turn {k} did not start")
            resp = await self.generate(req, sampling)
        if self.record is not None:
            self.record.setdefault(uuid, []).append(
                dict(
                    context=context,
                    token_ids=list(resp.token_ids),
                    logprobs=list(resp.logprobs),
                    versions=list(resp.weight_versions),
                    finish_reason=resp.finish_reason,
                    routed=resp.routed_experts,
                )
            )
        if resp.finish_reason == "interrupted":
            raise TurnInterrupted(f"{uuid}: a checkpoint interrupted turn {k} after {len(resp.token_ids)} tokens")
        if resp.routed_experts is not None:
            self.turns.setdefault(infer_request.uuid, []).append(
                (req.prompt_ids, list(resp.token_ids), resp.routed_experts)
            )
        text = self.tokenizer.decode(resp.token_ids, skip_special_tokens=True)
        choice = ResponseChoice(
            ChatMessage("assistant", text),
            list(resp.token_ids),
            resp.finish_reason,
            list(resp.logprobs),
            min(resp.weight_versions, default=0),
            token_versions=list(resp.weight_versions),
        )
        return ChatResponse([choice])

    async def _replayed(self, turn: dict, req: GenerationRequest, sampling, k: int) -> GenerationResponse:
        """A recorded turn as the engine gave it; an interrupted one continued from its prefix (the prompt and its
        tokens so far as the prompt, the rest of the turn's budget, a seed of its own) and joined."""
        done = GenerationResponse(
            list(turn["token_ids"]),
            list(turn["logprobs"]),
            turn["finish_reason"],
            list(turn["versions"]),
            routed_experts=turn.get("routed"),
        )
        left = sampling.max_tokens - len(turn["token_ids"])
        if turn["finish_reason"] != "interrupted" or self.stopping():  # a save settles: recorded again as it is
            return done
        if left <= 0:  # interrupted at its last token
            done.finish_reason = "length"
            return done
        seed = turn_seed(req.seed ^ 0x5EED, k + 1000)  # its own stream, not the prefix's
        more = await self.generate(
            GenerationRequest(req.prompt_ids + done.token_ids, seed, f"{req.request_id}-c", left), sampling
        )
        return GenerationResponse(
            done.token_ids + list(more.token_ids),
            done.logprobs + list(more.logprobs),
            more.finish_reason,
            done.weight_versions + list(more.weight_versions),
            routed_experts=more.routed_experts,  # its prompt held the prefix: routing of the whole turn
        )

    async def generate(self, request: GenerationRequest, sampling):
        future = asyncio.get_running_loop().create_future()
        if not self.coalesce:  # one engine call per turn
            await self._call([(request, sampling, future)])
            return await future
        self.pending.append((request, sampling, future))
        if not self.flushing:
            self.flushing = True
            asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            for _ in range(3):  # let every trajectory that is ready queue its turn first
                await asyncio.sleep(0)
            while self.pending:
                batch, self.pending = self.pending, []
                groups: dict = {}
                for item in batch:  # one engine call per distinct sampling (turns capped by a token budget differ)
                    groups.setdefault(astuple(item[1]), []).append(item)
                for group in groups.values():
                    if self.engine.capabilities.async_generate:
                        asyncio.ensure_future(self._call(group))
                    else:  # computes inline; the next flush takes what queued meanwhile
                        await self._call(group)
        finally:
            self.flushing = False

    async def _call(self, group: list) -> None:
        self.calls += 1
        try:
            out = await within(self.engine.generate([r for r, _, _ in group], group[0][1]), self.timeout)
        except asyncio.TimeoutError:
            out = TimeoutError(
                f"engine {self.engine.name} did not answer {len(group)} turns within "
                f"rollout.request_timeout_s={self.timeout:g} s"
            )
        except Exception as exc:  # noqa: BLE001  (each waiting trajectory gets it)
            out = exc
        for k, (_, _, future) in enumerate(group):
            if not future.done():
                future.set_exception(out) if isinstance(out, BaseException) else future.set_result(out[k])


async def run_trajectories(scheduler, requests: list, sampling, max_concurrent: int) -> list:
    """RolloutOutput or the exception, per request, in order; at most `max_concurrent` running at once."""
    gate = asyncio.Semaphore(max_concurrent)

    async def one(req):
        async with gate:
            error = None
            try:
                return await scheduler.run(req, sampling)
            except (Exception, TurnInterrupted) as exc:  # noqa: BLE001  (counted and reported by the caller)
                error = exc
                return exc
            finally:
                try:
                    await scheduler.on_trajectory_end([req], error)
                except Exception as exc:  # noqa: BLE001
                    log.warning("on_trajectory_end of %s raised %s: %s", req.uuid, type(exc).__name__, exc)

    return list(await asyncio.gather(*(one(r) for r in requests)))


def to_sample(
    out, request: InferRequest, group_id: int, info: dict, prompt_ids: list | None = None, turns: list | None = None
) -> Sample:
    """A finished trajectory as a Sample: flat tokens, one logprob per token (0.0 at mask-0 positions, which
    no loss reads), or None when the scheduler's logprobs do not match its mask-1 tokens (ms-swift's rule);
    with `turns` (TurnClient.turns of an MoE engine), the routed experts of every turn merged over the trajectory
    (`merge_turn_routing`; `info["routing_unrecorded"]` counts loss tokens whose experts no turn recorded).
    A trajectory that raised becomes an empty response on its original prompt (`prompt_ids`)."""
    if isinstance(out, BaseException):
        prompt = prompt_ids if prompt_ids is not None else request.prompt_ids
        return Sample(
            prompt_ids=list(prompt),
            group_id=group_id,
            finish_reason="abort",
            messages=request.messages,
            info=dict(info, trajectory_error=f"{type(out).__name__}: {out}"),
        )
    ids = flatten(out.response_token_ids)
    mask = flatten(out.response_loss_mask) if out.response_loss_mask else [1] * len(ids)
    lps = flatten(out.rollout_logprobs)
    dropped = len(lps) != sum(mask)
    if dropped:
        logprobs = None
    else:
        it = iter(lps)
        logprobs = [float(next(it)) if m else 0.0 for m in mask]
    infos = dict(out.rollout_infos or {})
    extra = dict(info, **infos, env_tokens=len(mask) - sum(mask))
    if dropped:
        extra["logprobs_dropped"] = True
    prompt = list(out.prompt_ids if out.prompt_ids is not None else request.prompt_ids)
    routed = None
    if turns:
        from mgrpo.models.routing import decode_routing, merge_turn_routing

        routed = merge_turn_routing(prompt + list(ids), turns)
        if routed is not None:  # row p predicts token p + 1: the loss tokens' rows start at len(prompt) - 1
            has = decode_routing(routed)[len(prompt) - 1 :, 0, 0] >= 0
            extra["routing_unrecorded"] = sum(1 for m, h in zip(mask, has.tolist()) if m and not h)
    return Sample(
        prompt_ids=prompt,
        response_ids=list(ids),
        loss_mask=list(mask),
        rollout_logprobs=logprobs,
        group_id=group_id,
        weight_version=out.weight_version,
        token_versions=list(out.token_versions) if len(out.token_versions or ()) == len(ids) else None,
        finish_reason=out.finish_reason,
        messages=out.messages,
        info=extra,
        routed_experts=routed,
    )


def report(samples: list, engine_name: str) -> None:
    """One warning per rollout for failed trajectories and dropped logprobs; all failed raises."""
    failed = [s for s in samples if "trajectory_error" in s.info]
    if failed and len(failed) == len(samples):
        raise AllTrajectoriesFailed(
            f"all {len(samples)} trajectories on engine {engine_name} failed; first: "
            f"{failed[0].info['trajectory_error']}"
        )
    if failed:
        log.warning(
            "%d of %d trajectories on engine %s raised and are left out of training; first: %s",
            len(failed),
            len(samples),
            engine_name,
            failed[0].info["trajectory_error"],
        )
    dropped = sum(1 for s in samples if s.info.get("logprobs_dropped"))
    if dropped:
        log.warning(
            "%d of %d trajectories returned rollout logprobs that do not match their mask-1 tokens; their "
            "rollout logprobs are dropped (ms-swift's rule): return rollout_logprobs from step() when it "
            "rewrites response_token_ids",
            dropped,
            len(samples),
        )


def fail_aborted(samples: list) -> None:
    """After scoring: a trajectory that raised trains nothing (NaN reward: no advantage, no loss)."""
    for s in samples:
        if "trajectory_error" in s.info:
            s.reward = math.nan
            s.info["reward_failed"] = ["trajectory"]


def trajectory_metrics(samples: list) -> dict:
    """rollout/num_turns/{mean,max}, rollout/env_tokens/mean (loss-mask-0 tokens), and the counters
    rollout/trajectories_failed, rollout/logprobs_dropped and (MoE engines that report routing)
    rollout/routing_unrecorded_tokens (loss tokens no turn's record covers: they route freely under replay)."""
    turns = [int(s.info.get("num_turns", 0)) for s in samples] or [0]
    out = {
        "rollout/num_turns/mean": sum(turns) / len(turns),
        "rollout/num_turns/max": max(turns),
        "rollout/env_tokens/mean": sum(s.info.get("env_tokens", 0) for s in samples) / max(len(samples), 1),
        "rollout/trajectories_failed": sum("trajectory_error" in s.info for s in samples),
        "rollout/logprobs_dropped": sum(bool(s.info.get("logprobs_dropped")) for s in samples),
    }
    if any("routing_unrecorded" in s.info for s in samples):
        out["rollout/routing_unrecorded_tokens"] = sum(s.info.get("routing_unrecorded", 0) for s in samples)
    return out


def context_limit(cfg) -> int | None:
    """`rollout.max_total_tokens`, or the longest context the engine serves (vLLM's max_model_len, else the
    model's max_position_embeddings)."""
    r = cfg.rollout
    if r.max_total_tokens:
        return r.max_total_tokens
    if r.engine == "vllm" and r.vllm.max_model_len:
        return r.vllm.max_model_len
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    except OSError:
        return None


def scheduled_share(
    scheduler, engine, cfg, requests: list, rows: list, group_ids: list, sampling, stopping=None
) -> list:
    """This engine's trajectories (one per GenerationRequest, its row beside it) as Samples, in order; those a
    checkpoint interrupted (`stopping`: true while it settles) as "interrupted" samples that can resume."""
    infer = []
    for req, row in zip(requests, rows):
        columns = {k: v for k, v in row.items() if k not in ("messages", "prompt_ids")}
        infer.append(dict(messages=row["messages"], columns=columns, uuid=req.request_id, seed=req.seed))
    return _run_scheduled(
        scheduler, engine, cfg, infer, [list(r.prompt_ids) for r in requests], group_ids, sampling, stopping, {}
    )


def continue_scheduled(scheduler, engine, cfg, samples: list, sampling, stopping=None) -> list:
    """Interrupted trajectories (`info["resume"]`) run again from their start, every recorded turn answered from
    the record (the module's docstring); finished ones come back as they are. Samples in the same order."""
    todo = [s for s in samples if _resumable(s)]
    infer = [{k: s.info["resume"][k] for k in ("messages", "columns", "uuid", "seed")} for s in todo]
    replay = {s.info["resume"]["uuid"]: s.info["resume"]["turns"] for s in todo}
    done = _run_scheduled(
        scheduler,
        engine,
        cfg,
        infer,
        [list(s.prompt_ids) for s in todo],
        [s.group_id for s in todo],
        sampling,
        stopping,
        replay,
    )
    for s, d in zip(todo, done):
        if d.finish_reason != "interrupted":
            d.info["continued_from"] = sum(len(t["token_ids"]) for t in s.info["resume"]["turns"])
    continued = iter(done)
    return [next(continued) if _resumable(s) else s for s in samples]


def _resumable(sample) -> bool:
    """An interrupted trajectory that kept its turns (`info["resume"]`): `continue_scheduled` continues it."""
    return sample.finish_reason == "interrupted" and "resume" in sample.info


def _run_scheduled(
    scheduler, engine, cfg, infer: list, prompts: list, group_ids: list, sampling, stopping, replay: dict
) -> list:
    client = TurnClient(engine, scheduler.tokenizer, cfg.rollout.request_timeout_s, stopping=stopping, replay=replay)
    scheduler.infer_engine = client
    requests = [
        InferRequest(
            messages=copy.deepcopy(t["messages"]),
            data_dict=copy.deepcopy(t["columns"]),
            uuid=t["uuid"],
            prompt_ids=list(p),
            seed=t["seed"],
        )
        for t, p in zip(infer, prompts)
    ]
    outs = asyncio.run(run_trajectories(scheduler, requests, sampling, cfg.rollout.max_concurrent))
    samples = []
    for o, r, g, t, p in zip(outs, requests, group_ids, infer, prompts):
        info = dict(t["columns"], engine=engine.name)
        if r.uuid in client.mismatched:
            info["replay_mismatch"] = 1
        if isinstance(o, TurnInterrupted):  # its turns so far, to replay (JSON: a checkpoint stores it)
            resume = dict(t, turns=(client.record or {}).get(r.uuid, []))
            samples.append(
                Sample(
                    prompt_ids=p,
                    group_id=g,
                    finish_reason="interrupted",
                    messages=t["messages"],
                    info=dict(info, resume=resume),
                )
            )
            continue
        samples.append(to_sample(o, r, g, info, p, client.turns.get(r.uuid)))
    report(samples, engine.name)
    return samples
