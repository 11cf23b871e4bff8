"""Scheduler logic with a scripted fake engine (logic only; the real engines are in test_prefix_property.py):
mask and logprob alignment across turns, continuation vs a new assistant message, max_turns, done from
on_turn_end, a raising trajectory, the logprob-count rule, the token budget and the concurrency bound."""

import asyncio
import logging
import math

import pytest
from fake_engine import ScriptedEngine, fake_logprob

from mgrpo.data.dataset import encode_prompt
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.rollout.multiturn import MultiTurnScheduler, multi_turns
from mgrpo.rollout.multiturn.driver import (
    AllTrajectoriesFailed,
    TurnClient,
    fail_aborted,
    report,
    run_trajectories,
    to_sample,
    trajectory_metrics,
)
from mgrpo.rollout.multiturn.tokens import MessageTokens
from mgrpo.rollout.multiturn.types import InferRequest
from mgrpo.rollout.types import SamplingParams

SP = SamplingParams(temperature=1.0, max_tokens=200)


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return load_tokenizer(tiny_dirs("think_dropping", chat_template="think_dropping"))


def rollout(tok, scheduler, script, rows, max_concurrent=8, sampling=SP, engine=None):
    engine = engine or ScriptedEngine(tok, script)
    scheduler.infer_engine = TurnClient(engine, tok, 30)
    reqs = [
        InferRequest(
            messages=[dict(m) for m in row["messages"]],
            data_dict=dict(row),
            uuid=f"u{i}",
            prompt_ids=encode_prompt(tok, row["messages"]),
            seed=i,
        )
        for i, row in enumerate(rows)
    ]
    outs = asyncio.run(run_trajectories(scheduler, reqs, sampling, max_concurrent))
    return [to_sample(o, r, 0, {}) for o, r in zip(outs, reqs)], reqs, engine


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def check_alignment(s):
    assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs)
    for t, m, lp in zip(s.response_ids, s.loss_mask, s.rollout_logprobs):
        assert lp == (fake_logprob(t) if m else 0.0)


def check_prefixes(engine, samples):
    """Every turn's prompt = the previous turn's prompt + everything appended since (model then environment)."""
    by_uuid = {}
    for uuid, turn, prompt in engine.requests:
        by_uuid.setdefault(uuid, {})[turn] = prompt
    for i, s in enumerate(samples):
        turns = by_uuid[f"u{i}"]
        full = s.prompt_ids + s.response_ids
        for k in sorted(turns):
            assert full[: len(turns[k])] == turns[k], f"turn {k} prompt is not a prefix of the final stream"
            if k > 1:
                assert turns[k][: len(turns[k - 1])] == turns[k - 1]


def test_tool_call_continues_the_assistant_message(tok):
    turn1 = "Let me add.\nAction: calculator\nAction Input: 3+4\nObservation: 99 (made up)"
    script = lambda uuid, turn, _: turn1 if turn == 1 else "So the answer is 7."  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": "What is 3+4?"}]}]
    (s,), (req,), engine = rollout(tok, multi_turns["tool_call"](None, 4, tokenizer=tok), script, rows)
    kept = enc(tok, "Let me add.\nAction: calculator\nAction Input: 3+4\n")
    observation = enc(tok, "Observation: Result: 7\n")
    final = enc(tok, "So the answer is 7.") + [tok.eos_token_id]
    assert s.response_ids[: len(kept)] == kept  # the invented observation (and its logprobs) are gone
    assert s.response_ids == kept + observation + final
    assert s.loss_mask == [1] * len(kept) + [0] * len(observation) + [1] * len(final)
    check_alignment(s)
    check_prefixes(engine, [s])
    assert s.info["num_turns"] == 2 and s.finish_reason == "stop"
    # one assistant message, continued: the tool result inside it (ms-swift's ToolCallScheduler layout)
    assert [m["role"] for m in s.messages] == ["user", "assistant"]
    assert s.messages[-1]["content"] == tok.decode(kept + observation + final, skip_special_tokens=True)


def test_gym_appends_new_user_messages_and_ends_on_done(tok):
    guesses = {1: "3", 2: "9", 3: "5", 4: "5"}
    script = lambda uuid, turn, _: guesses[turn]  # noqa: E731
    rows = [{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "target": 5}]
    (s,), _, engine = rollout(tok, multi_turns["gym"](None, 6, tokenizer=tok, gym_env="guess_number"), script, rows)
    assert s.info["num_turns"] == 3 and s.info["gym_done"] is True  # done from on_turn_end, before max_turns
    assert s.info["step_rewards"][-1] == 1.0 and s.info["total_reward"] == pytest.approx(sum(s.info["step_rewards"]))
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    # the prompt is the environment's first observation, encoded once
    assert s.prompt_ids == encode_prompt(tok, s.messages[:1])
    # model turns end with <|im_end|> (trained); the template's "\n<|im_start|>user\n...<|im_start|>assistant\n"
    # follows with mask 0, without a second <|im_end|>
    tail = MessageTokens(tok).new_messages([s.messages[2]])
    assert tail[0] == tok.eos_token_id
    first = enc(tok, "3") + [tok.eos_token_id]
    assert s.response_ids[: len(first) + len(tail) - 1] == first + tail[1:]
    assert s.loss_mask[: len(first) + len(tail) - 1] == [1] * len(first) + [0] * (len(tail) - 1)
    check_alignment(s)
    check_prefixes(engine, [s])


class AppendText(MultiTurnScheduler):
    """Appends text to the assistant message (no ids returned: the loop encodes it), then a user message."""

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]["content"] += "\n</think>\nnoted"
        infer_request.messages.append({"role": "user", "content": f"turn {current_turn} done"})
        return {"infer_request": infer_request}


def test_appended_text_and_messages_never_retemplate(tok):
    script = lambda uuid, turn, _: f"<think>step {turn}"  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": "go"}]}]
    (s,), _, engine = rollout(tok, AppendText(None, 3, tokenizer=tok), script, rows)
    check_alignment(s)
    check_prefixes(engine, [s])
    first = enc(tok, "<think>step 1")  # the model's <|im_end|> is dropped: its message went on
    env = enc(tok, "\n</think>\nnoted") + MessageTokens(tok).new_messages([{"role": "user", "content": "turn 1 done"}])
    assert s.response_ids[: len(first) + len(env)] == first + env
    assert s.loss_mask[: len(first) + len(env)] == [1] * len(first) + [0] * len(env)
    # negative control: re-templating the final conversation drops the earlier <think> blocks (this template
    # does as Qwen3's), so it cannot reproduce the tokens the model was given
    retemplated = tok.apply_chat_template(s.messages[:-1], add_generation_prompt=True, tokenize=False)
    assert "<think>step 1" not in retemplated and "<think>step 1" in tok.decode(s.prompt_ids + s.response_ids)


def test_max_turns_and_length_stop(tok):
    always_call = lambda uuid, turn, _: "Action: calculator\nAction Input: 1+1\n"  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": "q"}]}] * 3
    samples, _, _ = rollout(tok, multi_turns["tool_call"](None, 3, tokenizer=tok), always_call, rows)
    assert [s.info["num_turns"] for s in samples] == [3, 3, 3]
    long_turn = lambda uuid, turn, _: "Action: calculator\nAction Input: 1+1\n" + "x" * 80 + "~"  # noqa: E731
    samples, _, _ = rollout(
        tok,
        multi_turns["tool_call"](None, 5, tokenizer=tok),
        long_turn,
        rows[:1],
        sampling=SamplingParams(max_tokens=200),
    )
    # a call in the turn, but the turn ran out of tokens: check_finished's default stops on "length"
    assert samples[0].info["num_turns"] == 1 and samples[0].finish_reason == "length"


def test_max_total_tokens_ends_with_length(tok):
    guesses = lambda uuid, turn, _: "1"  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": "x"}], "target": 20}]
    sch = multi_turns["gym"](None, None, tokenizer=tok, gym_env="guess_number", max_total_tokens=120)
    (s,), _, engine = rollout(tok, sch, guesses, rows)
    assert s.finish_reason == "length" and len(s.prompt_ids) + len(s.response_ids) <= 120
    assert all(len(p) < 120 for _, _, p in engine.requests)
    check_alignment(s)
    full = multi_turns["gym"](None, None, tokenizer=tok, gym_env="guess_number", max_total_tokens=5)
    (s,), _, engine = rollout(tok, full, guesses, rows)  # the prompt alone fills the budget: no call at all
    assert s.finish_reason == "length" and s.response_ids == [] and s.info["num_turns"] == 0
    assert engine.requests == []


class DoneAtTwo(MultiTurnScheduler):
    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {"done": current_turn == 2, "rollout_infos": {"seen": current_turn}}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request}


class Flaky(DoneAtTwo):
    def step(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == "u1":
            raise RuntimeError("tool server down")
        return super().step(infer_request, response_choice, current_turn)


def test_done_from_on_turn_end_and_a_raising_trajectory(tok, caplog):
    rows = [{"messages": [{"role": "user", "content": "q"}]}] * 3
    samples, _, _ = rollout(tok, DoneAtTwo(None, 10, tokenizer=tok), lambda *_: "ok", rows)
    assert [s.info["num_turns"] for s in samples] == [2, 2, 2] and samples[0].info["seen"] == 2
    samples, _, _ = rollout(tok, Flaky(None, 10, tokenizer=tok), lambda *_: "ok", rows)
    assert "tool server down" in samples[1].info["trajectory_error"] and samples[1].finish_reason == "abort"
    assert "trajectory_error" not in samples[0].info and samples[0].info["num_turns"] == 2
    for s in samples:
        s.reward = 1.0
    fail_aborted(samples)
    assert math.isnan(samples[1].reward) and samples[0].reward == 1.0  # kept out of advantages and loss
    with caplog.at_level(logging.WARNING, logger="mgrpo.rollout.multiturn"):
        report(samples, "scripted#0")
    assert "1 of 3 trajectories" in caplog.text
    assert trajectory_metrics(samples)["rollout/trajectories_failed"] == 1
    with pytest.raises(AllTrajectoriesFailed, match="tool server down"):
        report([samples[1]], "scripted#0")


class BadLogprobs(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        ids = list(response_choice.token_ids)
        infer_request.messages[-1]["content"] += "!"
        return {
            "infer_request": infer_request,
            "response_token_ids": ids + enc(self.tokenizer, "!"),
            "response_loss_mask": [1] * len(ids) + [0],
            "rollout_logprobs": [-1.0],
        }  # too few


def test_logprob_count_rule_drops_them(tok, caplog):
    rows = [{"messages": [{"role": "user", "content": "q"}]}] * 2
    samples, _, _ = rollout(tok, BadLogprobs(None, 2, tokenizer=tok), lambda *_: "abc", rows)
    for s in samples:
        assert s.rollout_logprobs is None and s.info["logprobs_dropped"] is True
        assert len(s.response_ids) == len(s.loss_mask)
    with caplog.at_level(logging.WARNING, logger="mgrpo.rollout.multiturn"):
        report(samples, "scripted#0")
    assert "2 of 2 trajectories returned rollout logprobs" in caplog.text
    assert trajectory_metrics(samples)["rollout/logprobs_dropped"] == 2


class Rewrites(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]["content"] = "something else"
        return {"infer_request": infer_request}


def test_rewriting_the_message_without_ids_is_an_error(tok):
    rows = [{"messages": [{"role": "user", "content": "q"}]}]
    (s,), _, _ = rollout(tok, Rewrites(None, 3, tokenizer=tok), lambda *_: "abc", rows)
    assert "SchedulerError" in s.info["trajectory_error"] and "response_token_ids" in s.info["trajectory_error"]


@pytest.mark.parametrize("async_engine", [True, False])
def test_concurrency_bound_counted_at_the_engine(tok, async_engine):
    rows = [{"messages": [{"role": "user", "content": "x"}], "target": 7}] * 40
    engine = ScriptedEngine(tok, lambda u, t, _: str(t), async_generate=async_engine, delay=0.002)
    samples, _, _ = rollout(
        tok,
        multi_turns["gym"](None, 3, tokenizer=tok, gym_env="guess_number"),
        None,
        rows,
        max_concurrent=6,
        engine=engine,
    )
    assert len(samples) == 40 and all(s.info["num_turns"] == 3 for s in samples)
    assert 1 < engine.peak <= 6  # requests at the engine at once
    if async_engine:  # one call per turn: the engine batches continuously
        assert engine.calls == 40 * 3
    else:  # computes inline: the turns ready at the same moment share one call
        assert engine.calls < 40 * 3


def test_math_tips_truncates_and_tips_once(tok):
    script = lambda uuid, turn, _: "<think>2+2 is 5</think><answer>5</answer>" if turn == 1 else "4"  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "solution": "4"}]
    (s,), _, engine = rollout(tok, multi_turns["math_tips"](None, 5, tokenizer=tok), script, rows)
    sch = multi_turns["math_tips"](None, 5, tokenizer=tok)
    kept, tips = enc(tok, "<think>2+2 is 5"), enc(tok, sch.tips_prompt)
    assert s.response_ids[: len(kept) + len(tips)] == kept + tips
    assert s.loss_mask[: len(kept) + len(tips)] == [1] * len(kept) + [0] * len(tips)
    assert s.info["num_turns"] == 2 and s.info["tipped"] is True
    check_alignment(s)
    check_prefixes(engine, [s])
    right = lambda uuid, turn, _: "<answer>4</answer>"  # noqa: E731
    (s,), _, _ = rollout(tok, sch, right, rows)
    assert s.info["num_turns"] == 1


def test_calculator_is_arithmetic_only():
    from mgrpo.rollout.multiturn.tool_call import calculate, calculator_tool

    assert calculate("(3 + 4) * 5") == 35 and calculate("7 / 2") == 3.5 and calculate("-2 ** 3") == -8
    for bad in ("__import__('os').system('true')", "a + 1", "2 ** 100000", "(1).real", "[1, 2]", "1 / 0", ""):
        assert calculator_tool(bad).startswith("Error:"), bad


def test_message_tokens_match_the_template(tok):
    """The tail of appended messages equals what the template renders after a conversation."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>a</think>b"}]
    new = [{"role": "user", "content": "more"}]
    full = tok.apply_chat_template(history + new, tokenize=False, add_generation_prompt=True)
    tail = MessageTokens(tok).render_tail(new)
    assert full.endswith(tail) and tail.startswith("<|im_end|>\n<|im_start|>user\nmore")


class VersionedEngine(ScriptedEngine):
    """Turn k's tokens come from weight version k, except that turn 2 straddles a push (its second half: 3)."""

    async def generate(self, requests, sampling):
        out = await super().generate(requests, sampling)
        for r, o in zip(requests, out):
            turn = int(r.request_id.rsplit("-t", 1)[1])
            half = len(o.token_ids) // 2
            o.weight_versions = [turn] * half + [turn + (turn == 2)] * (len(o.token_ids) - half)
        return out


def test_token_versions_follow_every_turn(tok):
    """Partial rollout across turns: each model token keeps the version that sampled it (turn 2 spans 2 and 3),
    environment tokens carry the latest version before them, and the sample's weight_version is the oldest."""
    guesses = {1: "3", 2: "9 is my guess", 3: "5"}
    script = lambda uuid, turn, _: guesses[turn]  # noqa: E731
    rows = [{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "target": 5}]
    scheduler = multi_turns["gym"](None, 6, tokenizer=tok, gym_env="guess_number")
    (s,), _, _ = rollout(tok, scheduler, script, rows, engine=VersionedEngine(tok, script))
    assert s.info["num_turns"] == 3 and len(s.token_versions) == len(s.response_ids)
    model = [v for v, m in zip(s.token_versions, s.loss_mask) if m]
    turn1 = len(enc(tok, "3")) + 1
    turn2 = len(enc(tok, "9 is my guess")) + 1
    assert model == [1] * turn1 + [2] * (turn2 // 2) + [3] * (turn2 - turn2 // 2) + [3] * (len(model) - turn1 - turn2)
    env = [v for v, m in zip(s.token_versions, s.loss_mask) if not m]
    assert set(env[: env.index(3)]) == {1} and set(env[env.index(3) :]) == {3}
    assert s.weight_version == 1
