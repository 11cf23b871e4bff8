"""RolloutManager: shares keep groups on one engine, seeds per sample, bounded calls, and a per-call timeout
that fails the step with one line naming the engine. A scripted engine stands in where only scheduling logic is
under test (it never counts as testing an engine)."""

import asyncio
import time

import pytest

from mgrpo.config import load_config
from mgrpo.rollout.engine import Capabilities, request_seed
from mgrpo.rollout.manager import RolloutError, RolloutManager, shares
from mgrpo.rollout.types import GenerationResponse


class ScriptedEngine:
    """Answers each request with its seed's low bits as tokens; records call sizes; can stall forever."""

    def __init__(self, name="scripted#0", stall=False, async_generate=False):
        self.name, self.stall, self.calls, self.version = name, stall, [], 0
        self.capabilities = Capabilities(async_generate=async_generate)

    async def generate(self, requests, sampling):
        self.calls.append(len(requests))
        if self.stall:
            await asyncio.sleep(3600)
        return [GenerationResponse([r.seed % 97, 1], [-0.5, -0.25], "stop", [self.version] * 2) for r in requests]


class Tok:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 50 for c in text]}


def cfg(*extra):
    return load_config(
        argv=["--model.path", "m", "--rollout.n", "3", "--rollout.prompts_per_step", "4", *extra], check_files=False
    )


ROWS = [{"messages": [{"role": "user", "content": f"prompt {i}"}], "answer": i} for i in range(4)]


def test_shares_keep_groups_whole():
    assert [list(r) for r in shares(8, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [list(r) for r in shares(2, 2)] == [[0], [1]]


def test_one_engine_and_two_engines_give_the_same_samples():
    one = RolloutManager(cfg(), Tok(), {0: 0}, ScriptedEngine()).generate_share(ROWS, step=5)
    parts = [
        RolloutManager(cfg(), Tok(), {0: 0, 1: 2}, ScriptedEngine(f"scripted#{k}"), k).generate_share(ROWS, 5)
        for k in range(2)
    ]
    two = parts[0] + parts[1]
    assert [s.response_ids for s in one] == [s.response_ids for s in two]
    assert [s.group_id for s in one] == [20, 20, 20, 21, 21, 21, 22, 22, 22, 23, 23, 23]
    assert one[4].response_ids[0] == request_seed(1234, 5, 1, 1) % 97, "seed from (run seed, step, prompt, sample)"
    assert {s.info["engine"] for s in parts[1]} == {"scripted#1"} and parts[1][0].info["answer"] == 2


def test_calls_are_bounded_per_engine():
    eng = ScriptedEngine()
    RolloutManager(cfg("--rollout.max_inflight", "5"), Tok(), {0: 0}, eng).generate_share(ROWS, 0)
    assert eng.calls == [5, 5, 2]


@pytest.mark.parametrize("async_generate", [False, True])
def test_a_stalled_engine_fails_within_the_timeout_naming_it(async_generate):
    eng = ScriptedEngine("sleepy#0", stall=True, async_generate=async_generate)
    manager = RolloutManager(cfg("--rollout.request_timeout_s", "0.5"), Tok(), {0: 0}, eng)
    t0 = time.perf_counter()
    with pytest.raises(RolloutError) as e:
        manager.generate_share(ROWS, 0)
    took = time.perf_counter() - t0
    assert took < 2.0, f"took {took:.1f} s for a 0.5 s timeout"
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("engine sleepy#0 did not answer") and "request_timeout_s=0.5" in msg


def test_the_trainer_step_fails_on_every_rank_with_that_line(single_rank, tmp_path, tiny_dirs):
    import os

    from mgrpo.trainer import GRPOTrainer

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    c = load_config(
        os.path.join(root, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(root, "examples/data/tiny_prompts.jsonl"),
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--logging.progress_bar",
            "false",
            "--rollout.request_timeout_s",
            "0.5",
        ],
    )
    trainer = GRPOTrainer(c)
    trainer.rollout.engine = trainer.engine = ScriptedEngine("sleepy#0", stall=True)
    with pytest.raises(RolloutError, match=r"^step 0: RolloutError: engine sleepy#0 did not answer"):
        trainer.step(0)


def test_in_process_transport_hands_over_views_not_copies():
    import torch

    from mgrpo.weights.transports.in_process import InProcessTransport

    class Recorder(ScriptedEngine):
        def update_weights(self, buckets, version):
            self.got = [(n, t) for b in buckets for n, t in b.tensors()]
            self.version = version
            return {"version": version}

    tensors = [(f"w{i}", torch.randn(100, 10)) for i in range(5)]
    eng = Recorder()
    InProcessTransport(eng, bucket_bytes=8000).send(iter(tensors), 3)
    assert eng.version == 3 and [n for n, _ in eng.got] == [n for n, _ in tensors]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(eng.got, tensors)), "no packing copy"


def test_capabilities_and_registry_are_checked_at_start():
    from mgrpo.config import ConfigError
    from mgrpo.rollout.engine import check_capabilities

    raw = ScriptedEngine("raw#0")
    raw.capabilities = Capabilities(logprobs="raw")
    with pytest.raises(ValueError, match="engine raw#0 returns raw logprobs"):
        check_capabilities(raw, cfg())
    check_capabilities(ScriptedEngine(), cfg())
    with pytest.raises(ConfigError, match="rollout.engine='sglang2' is not available in this build"):
        cfg("--rollout.engine", "sglang2")
    with pytest.raises(ConfigError, match="rollout.engine=sglang with rollout.remote.transport='http'"):
        cfg(
            "--rollout.engine",
            "sglang",
            "--rollout.servers",
            "http://127.0.0.1:1",
            "--rollout.remote.transport",
            "http",
        )
    assert (
        cfg("--rollout.engine", "sglang", "--rollout.servers", "http://127.0.0.1:1").rollout.remote.transport
        == "collective"
    )  # auto
    assert (
        cfg("--rollout.engine", "remote", "--rollout.servers", "http://127.0.0.1:1").rollout.remote.transport == "http"
    )
    with pytest.raises(ConfigError, match=r"rollout.vllm.update_ring=1; use 0 .* or >= 2"):
        cfg("--rollout.engine", "vllm", "--rollout.vllm.update_ring", "1")
    with pytest.raises(ConfigError, match="rollout.vllm.dtype='fp8'"):
        cfg("--rollout.engine", "vllm", "--rollout.vllm.dtype", "fp8")
    assert cfg("--rollout.engine", "vllm").rollout.vllm.dtype == "auto"
    with pytest.raises(ConfigError, match="rollout.engine_placement='per_node'; use rank0 or per_dp"):
        cfg("--rollout.engine_placement", "per_node")


def test_truncated_sampling_warns_why_logprobs_differ():
    from mgrpo.rollout.engine import truncation_warning

    assert truncation_warning(cfg()) is None
    for flags in (("--rollout.top_p", "0.9"), ("--rollout.top_k", "20")):
        text = truncation_warning(cfg(*flags))
        assert "renormalised" in text and "rollout_is/rollout_logp_abs_diff" in text


class DyingEngine(ScriptedEngine):
    """Its process is gone: generate raises as a closed socket does, and alive() says so; restart() is recorded."""

    def __init__(self, name):
        super().__init__(name)
        self.restarted = 0

    async def generate(self, requests, sampling):
        raise ConnectionResetError("connection closed by the other side")

    def alive(self):
        return False

    def restart(self):
        self.restarted += 1


def test_reissued_prompts_keep_their_seeds_and_groups():
    """A dead engine's prompts, generated by another engine: the same samples (seeds, group ids) as their own
    engine would have given. The reissue is what RolloutManager.share runs on an engine that is up."""
    ref = [
        RolloutManager(cfg(), Tok(), {0: 0, 1: 2}, ScriptedEngine(f"s#{k}"), k).generate_share(ROWS, 5) for k in (0, 1)
    ]
    dead = RolloutManager(cfg(), Tok(), {0: 0, 1: 2}, DyingEngine("d#1"), 1)
    payload = dead.generate_local(ROWS, 5)
    assert payload["down"].startswith("engine d#1 died") and payload["indices"] == [2, 3] and payload["restarted"]
    assert dead.engine.restarted == 1
    up = RolloutManager(cfg(), Tok(), {0: 0, 1: 2}, ScriptedEngine("s#0"), 0)
    again = up.generate_share(ROWS, 5, indices=payload["indices"])
    assert [(s.group_id, s.response_ids) for s in again] == [(s.group_id, s.response_ids) for s in ref[1]]


def test_every_engine_down_is_one_line(single_rank):
    dead = RolloutManager(cfg(), Tok(), {0: 0}, DyingEngine("d#0"), 0)
    with pytest.raises(RolloutError) as err:
        dead.rollout(ROWS, 2)
    assert str(err.value).startswith("every rollout engine is down: engine d#0 died (step 2: ConnectionResetError")
    assert "\n" not in str(err.value)


def test_a_restarted_engine_waits_for_a_push_and_its_prompts_go_elsewhere():
    engine = ScriptedEngine("s#1")
    engine.awaiting_push = True
    payload = RolloutManager(cfg(), Tok(), {0: 0, 1: 2}, engine, 1).generate_local(ROWS, 7)
    assert payload["down"] == "engine s#1 waits for a weight push after its restart" and not payload.get("restarted")
    assert payload["indices"] == [2, 3] and engine.calls == []
