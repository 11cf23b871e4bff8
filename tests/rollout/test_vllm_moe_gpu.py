"""GPU only (vLLM's routed experts come from its Model Runner V2, which needs Triton): the colocated vLLM engine
started for routing replay returns, per request, the experts of every token it ran ([prompt + response - 1,
moe_layers, topk]) with expert indices in range. (The trainer's side of the replay is tested on CPU with the HF
engine: tests/models/test_routing_replay.py.)"""

import pytest
from engine_helpers import run

pytestmark = pytest.mark.gpu


def test_vllm_returns_routed_experts_the_trainer_replays(single_rank, tiny_dirs):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.models.routing import decode_routing
    from mgrpo.rollout.engines.vllm import VLLMEngine
    from mgrpo.rollout.types import GenerationRequest, SamplingParams

    model = tiny_dirs("vllm_moe_gpu", family="qwen3_moe", vocab_size=300, num_layers=2, seed=2)
    eng = VLLMEngine(model, eos_token_id=load_tokenizer(model).eos_token_id, dtype="float32", routed_experts=True)
    try:
        reqs = [GenerationRequest(prompt_ids=list(range(10, 10 + n)), seed=n) for n in (5, 17)]
        out = run(eng, reqs, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    finally:
        eng.close()
    for r, o in zip(reqs, out):
        routed = decode_routing(o.routed_experts)
        assert routed.shape == (len(r.prompt_ids) + len(o.token_ids) - 1, 2, 2)
        assert int(routed.max()) < 8
