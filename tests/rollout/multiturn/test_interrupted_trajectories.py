"""A checkpoint of a partial run interrupts multi-turn trajectories (issue 56), scheduler logic with a scripted
engine (the real engines' interrupt is tested in test_vllm_engine.py and test_remote_engine.py): a trajectory
stops at its turn in flight, its sample stores every turn so far (JSON, as the checkpoint does), and continuing it
replays the recorded turns without the engine, continues the interrupted turn from its prefix and generates the
rest. The continued trajectory is the one an uninterrupted run gives (the script is deterministic)."""

import json
from types import SimpleNamespace

from fake_engine import fake_logprob

from mgrpo.data.dataset import encode_prompt
from mgrpo.data.tokenizer import load_tokenizer
from mgrpo.rollout.engine import Capabilities
from mgrpo.rollout.multiturn import multi_turns
from mgrpo.rollout.multiturn.driver import continue_scheduled, scheduled_share
from mgrpo.rollout.types import GenerationRequest, GenerationResponse, Sample, SamplingParams, sample_dict

SP = SamplingParams(temperature=1.0, max_tokens=200)
GUESSES = {1: "3", 2: "9 is my guess", 3: "5", 4: "5"}
CFG = SimpleNamespace(rollout=SimpleNamespace(request_timeout_s=30, max_concurrent=8))


class InterruptingEngine:
    """Turn k of every trajectory is GUESSES[k], sampled by weight version `version`. With `interrupt_turn`, that
    turn ends "interrupted" after its first 2 tokens, and once `trajectories` were, the checkpoint settles
    (`settling`: no new turn starts). A continuation (request id "...-c") returns the rest of its turn: what the turn would have been."""

    name = "scripted#0"

    def __init__(self, tok, interrupt_turn=None, version=3, trajectories=2):
        self.tok, self.interrupt_turn, self.settling, self.version = tok, interrupt_turn, False, version
        self.trajectories, self.interrupted = trajectories, 0
        self.capabilities = Capabilities(async_generate=True)
        self.asked = []  # (request id, prompt ids)

    def turn_ids(self, turn: int) -> list:
        return self.tok.encode(GUESSES[turn], add_special_tokens=False) + [self.tok.eos_token_id]

    async def generate(self, requests, sampling):
        out = []
        for r in requests:
            self.asked.append((r.request_id, list(r.prompt_ids)))
            rid = r.request_id.removesuffix("-c")
            ids = self.turn_ids(int(rid.rsplit("-t", 1)[1]))
            lps = [fake_logprob(t) for t in ids]
            if r.request_id.endswith("-c"):  # the prefix is the prompt's tail: the rest of the turn
                given = next(k for k in range(len(ids), 0, -1) if r.prompt_ids[-k:] == ids[:k])
                out.append(GenerationResponse(ids[given:], lps[given:], "stop", [self.version] * (len(ids) - given)))
            elif int(rid.rsplit("-t", 1)[1]) == self.interrupt_turn:
                self.interrupted += 1
                self.settling = self.interrupted == self.trajectories
                out.append(GenerationResponse(ids[:2], lps[:2], "interrupted", [self.version] * 2))
            else:
                out.append(GenerationResponse(ids, lps, "stop", [self.version] * len(ids)))
        return out


def share(tok, engine, rows):
    scheduler = multi_turns["gym"](None, 6, tokenizer=tok, gym_env="guess_number")
    requests = [
        GenerationRequest(encode_prompt(tok, row["messages"]), 100 + i, f"0-{i}-0") for i, row in enumerate(rows)
    ]
    out = scheduled_share(
        scheduler, engine, CFG, requests, rows, list(range(len(rows))), SP, stopping=lambda: engine.settling
    )
    return scheduler, out


def test_an_interrupted_trajectory_is_replayed_turn_by_turn_and_continued(tiny_dirs):
    tok = load_tokenizer(tiny_dirs("think_dropping", chat_template="think_dropping"))
    rows = [{"messages": [{"role": "user", "content": "x"}], "target": 5, "id": i} for i in range(2)]
    _, reference = share(tok, InterruptingEngine(tok), rows)
    assert [s.info["num_turns"] for s in reference] == [3, 3]

    scheduler, interrupted = share(tok, InterruptingEngine(tok, interrupt_turn=2), rows)
    assert [s.finish_reason for s in interrupted] == ["interrupted"] * 2
    stored = [Sample(**json.loads(json.dumps(sample_dict(s)))) for s in interrupted]  # as a checkpoint holds it
    turns = stored[0].info["resume"]["turns"]
    assert [t["finish_reason"] for t in turns] == ["stop", "interrupted"] and len(turns[1]["token_ids"]) == 2

    # a second save while they are being continued: nothing recorded is lost, the engine is asked for nothing
    engine = InterruptingEngine(tok)
    held = continue_scheduled(scheduler, engine, CFG, stored, SP, stopping=lambda: True)
    assert [s.info["resume"]["turns"] for s in held] == [s.info["resume"]["turns"] for s in stored]
    assert [s.finish_reason for s in held] == ["interrupted"] * 2 and engine.asked == []

    engine = InterruptingEngine(tok, version=4)  # the weights were pushed since
    continued = continue_scheduled(scheduler, engine, CFG, stored, SP, stopping=lambda: False)
    for ref, got in zip(reference, continued):
        assert got.finish_reason == ref.finish_reason == "stop"
        assert (got.response_ids, got.loss_mask, got.rollout_logprobs) == (
            ref.response_ids,
            ref.loss_mask,
            ref.rollout_logprobs,
        )
        assert got.messages == ref.messages and got.info["num_turns"] == 3
        assert got.info["continued_from"] == len(turns[0]["token_ids"]) + 2
        model = [v for v, m in zip(got.token_versions, got.loss_mask) if m]
        turn2 = len(engine.turn_ids(2))
        assert model == [3] * len(engine.turn_ids(1)) + [3, 3] + [4] * (turn2 - 2) + [4] * len(engine.turn_ids(3))
    asked = [rid for rid, _ in engine.asked]
    print(f"engine calls when continuing: {asked}")
    assert sorted(asked) == ["0-0-0-t2-c", "0-0-0-t3", "0-1-0-t2-c", "0-1-0-t3"], "turn 1 is replayed, not asked"

    # negative control: a scheduler that asks turn 1 with another context (here: its record tampered) is
    # generated afresh from that turn, and says so
    stored[0].info["resume"]["turns"][0]["context"] = "0:another"
    engine = InterruptingEngine(tok)
    again = continue_scheduled(scheduler, engine, CFG, stored, SP, stopping=lambda: False)
    assert again[0].info.get("replay_mismatch") == 1 and "replay_mismatch" not in again[1].info
    assert again[0].response_ids == reference[0].response_ids
    assert "0-0-0-t1" in [rid for rid, _ in engine.asked]


def test_a_trajectory_asking_for_a_turn_while_the_checkpoint_settles_stops_there(tiny_dirs):
    """Stopping starts no new turn: the trajectory ends "interrupted" with its finished turns only, and a
    continuation asks the engine for none of them."""
    tok = load_tokenizer(tiny_dirs("think_dropping", chat_template="think_dropping"))
    rows = [{"messages": [{"role": "user", "content": "x"}], "target": 5, "id": 0}]
    engine = InterruptingEngine(tok)
    engine.generate_real = engine.generate

    async def settle_after_turn_1(requests, sampling):
        out = await engine.generate_real(requests, sampling)
        engine.settling = True
        return out

    engine.generate = settle_after_turn_1
    scheduler, (s,) = share(tok, engine, rows)
    assert s.finish_reason == "interrupted" and [t["finish_reason"] for t in s.info["resume"]["turns"]] == ["stop"]
    engine = InterruptingEngine(tok)
    (done,) = continue_scheduled(scheduler, engine, CFG, [s], SP, stopping=lambda: False)
    assert done.finish_reason == "stop" and done.info["num_turns"] == 3
    assert [rid for rid, _ in engine.asked] == ["0-0-0-t2", "0-0-0-t3"]
