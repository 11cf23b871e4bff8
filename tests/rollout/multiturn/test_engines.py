"""Multi-turn rollouts on the real `hf` and `vllm` engines with a chat template that drops earlier <think> blocks
(as Qwen3's does): every turn's prompt extends the previous turn's prompt + response; every sample has one mask
entry and one logprob per response token; environment tokens sit exactly at the mask-0 spans; the engine's
logprobs at mask-1 positions equal the trainer's (megatron) forward within 1e-4 (fp32). Then 256 concurrent
gym trajectories on vLLM, with the bound on requests in flight counted inside the engine process."""

import asyncio
import os
import resource
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/rollout: engine_helpers
from engine_helpers import trainer_logprobs  # noqa: E402

from mgrpo.data.dataset import encode_prompt  # noqa: E402
from mgrpo.data.tokenizer import load_tokenizer  # noqa: E402
from mgrpo.rollout.multiturn import MultiTurnScheduler, multi_turns  # noqa: E402
from mgrpo.rollout.multiturn.driver import TurnClient, run_trajectories, to_sample  # noqa: E402
from mgrpo.rollout.multiturn.types import InferRequest  # noqa: E402
from mgrpo.rollout.types import SamplingParams  # noqa: E402

SP = SamplingParams(temperature=1.0, max_tokens=12)


class ThinkThenAsk(MultiTurnScheduler):
    """Closes a <think> inside the model's message (text appended, mask 0) and asks again (a new user message):
    re-templating would now drop the model's first-turn tokens."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]["content"] += "\n</think>\nnoted"
        infer_request.messages.append({"role": "user", "content": f"and now step {current_turn + 1}?"})
        return {"infer_request": infer_request}

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns


class Recording:
    """The real engine, with every turn's request and response kept for the checks."""

    def __init__(self, engine):
        self.engine, self.name, self.capabilities = engine, engine.name, engine.capabilities
        self.log = {}

    async def generate(self, requests, sampling):
        out = await self.engine.generate(requests, sampling)
        for r, o in zip(requests, out):
            uuid, turn = r.request_id.rsplit("-t", 1)
            self.log.setdefault(uuid, {})[int(turn)] = (list(r.prompt_ids), list(o.token_ids))
        return out


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs("think_dropping", chat_template="think_dropping")


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engines(model_dir, tok):
    from mgrpo.rollout.engines.hf import HFEngine
    from mgrpo.rollout.engines.vllm import VLLMEngine

    made = {"hf": HFEngine(model_dir, tok.eos_token_id, tok.pad_token_id)}
    made["vllm"] = VLLMEngine(model_dir, eos_token_id=tok.eos_token_id, max_num_seqs=256)
    made["hf"].name, made["vllm"].name = "hf#0", "vllm#0"
    yield made
    made["vllm"].close()


def rollout(engine, tok, scheduler, rows, max_concurrent=16, sampling=SP):
    scheduler.infer_engine = TurnClient(engine, tok, 300)
    reqs = [
        InferRequest(
            messages=[dict(m) for m in row["messages"]],
            data_dict=dict(row),
            uuid=f"u{i}",
            prompt_ids=encode_prompt(tok, row["messages"]),
            seed=1000 + i,
        )
        for i, row in enumerate(rows)
    ]
    outs = asyncio.run(run_trajectories(scheduler, reqs, sampling, max_concurrent))
    return [to_sample(o, r, 0, {}) for o, r in zip(outs, reqs)]


def check_token_accounting(sample, turns: dict, eos: int):
    """Rebuild the mask from the engine's own record: each turn's generated tokens are mask 1 where the stream
    holds them (a continued message drops its end-of-turn token); everything between one turn's tokens and the
    next turn's prompt end is what the environment wrote, mask 0."""
    prompt, stream = sample.prompt_ids, sample.prompt_ids + sample.response_ids
    assert len(sample.response_ids) == len(sample.loss_mask) == len(sample.rollout_logprobs)
    expected_mask = []
    for k in sorted(turns):
        turn_prompt, generated = turns[k]
        assert stream[: len(turn_prompt)] == turn_prompt, f"turn {k}'s prompt is not a prefix of the stream"
        if k > 1:
            assert turn_prompt[: len(turns[k - 1][0])] == turns[k - 1][0]
        assert len(turn_prompt) == len(prompt) + len(expected_mask)
        end = len(turns[k + 1][0]) if k + 1 in turns else len(stream)
        kept = (
            generated if stream[len(turn_prompt) : len(turn_prompt) + len(generated)] == generated else generated[:-1]
        )  # continued: the model's <|im_end|> left the message
        assert kept == generated or generated[-1] == eos
        assert stream[len(turn_prompt) : len(turn_prompt) + len(kept)] == kept
        expected_mask += [1] * len(kept) + [0] * (end - len(turn_prompt) - len(kept))
    assert sample.loss_mask == expected_mask
    return expected_mask


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_prefix_property_and_logprobs_on_real_engines(name, engines, tok, model_dir, single_rank):
    engine = Recording(engines[name])
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}], "target": 3 + i} for i in range(4)]
    worst, checked, runs = 0.0, 0, []
    for scheduler in (
        ThinkThenAsk(None, 3, tokenizer=tok),
        multi_turns["gym"](None, 3, tokenizer=tok, gym_env="guess_number"),
    ):
        samples = rollout(engine, tok, scheduler, [dict(r) for r in rows])
        runs.append(samples)
        for i, s in enumerate(samples):
            assert "trajectory_error" not in s.info, s.info
            mask = check_token_accounting(s, engine.log[f"u{i}"], tok.eos_token_id)
            assert 0 < sum(mask) < len(mask)  # both model and environment tokens
            ref = trainer_logprobs(model_dir, s.prompt_ids, s.response_ids, 1.0)
            on = torch.tensor(mask, dtype=torch.bool)
            worst = max(worst, float((ref[on] - torch.tensor(s.rollout_logprobs)[on]).abs().max()))
            checked += int(on.sum())
        engine.log.clear()
    think = runs[0]
    assert all(s.info["num_turns"] == 3 for s in think)
    # re-templating the conversation would drop the model's first-turn tokens (the reason for token in, token out)
    retemplated = tok.apply_chat_template(think[0].messages[:-1], add_generation_prompt=True, tokenize=True)
    retemplated = list(retemplated["input_ids"] if hasattr(retemplated, "keys") else retemplated)
    assert (think[0].prompt_ids + think[0].response_ids)[: len(retemplated)] != retemplated
    assert checked > 100 and worst <= 1e-4, f"{name}: worst |engine - trainer| = {worst:.2e} over {checked} tokens"


def test_256_concurrent_gym_trajectories_on_vllm(engines, tok):
    engine, bound = engines["vllm"], 32
    engine.stats(reset=True)
    rows = [{"messages": [{"role": "user", "content": "x"}], "target": 1 + i % 20} for i in range(256)]
    t0 = time.perf_counter()
    samples = rollout(
        engine,
        tok,
        multi_turns["gym"](None, 3, tokenizer=tok, gym_env="guess_number"),
        rows,
        max_concurrent=bound,
        sampling=SamplingParams(temperature=1.0, max_tokens=8),
    )
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    with open(f"/proc/{engine.pid}/status") as f:
        engine_hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    trainer_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nresult: trajectories=256 max_concurrent={bound} engine_peak_inflight={stats['requests_peak']} "
        f"seconds={seconds:.1f} turns={sum(s.info['num_turns'] for s in samples)} "
        f"driver_peak_rss_mb={trainer_rss:.0f} engine_peak_rss_mb={engine_hwm:.0f}"
    )
    assert len(samples) == 256 and not any("trajectory_error" in s.info for s in samples)
    assert 1 < stats["requests_peak"] <= bound


@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_single_turn_scheduler_samples_what_the_batched_path_does(name, engines, tok):
    """Turn 1 keeps the request's own seed: a `single_turn` scheduler gives the batched path's samples."""
    from mgrpo.rollout.types import GenerationRequest

    rows = [{"messages": [{"role": "user", "content": f"say {i}"}]} for i in range(3)]
    samples = rollout(engines[name], tok, multi_turns["single_turn"](None, None, tokenizer=tok), rows)
    direct = asyncio.run(
        engines[name].generate(
            [GenerationRequest(encode_prompt(tok, r["messages"]), 1000 + i, f"d{i}") for i, r in enumerate(rows)], SP
        )
    )
    assert [s.response_ids for s in samples] == [d.token_ids for d in direct]
    assert all(s.loss_mask == [1] * len(s.response_ids) for s in samples)
