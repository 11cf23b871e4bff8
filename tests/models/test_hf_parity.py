"""Megatron TP1 logits equal HF transformers' logits (fp32) for every supported family."""

import pytest
import torch

from mgrpo.models.builder import build_model
from mgrpo.models.forward import full_logits
from mgrpo.weights.load import load_hf

ABS, REL = 1e-5, 1e-4
REL_FLOOR = 1e-2  # rel = |ours - ref| / max(|ref|, 1e-2): near-zero logits only have fp32 noise in their ratio
SEQ = 96
LLAMA_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 6.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    # name: (make_tiny_hf kwargs) ; vocab 300 is padded to 384 by megatron
    "qwen2": dict(family="qwen2", vocab_size=300),
    "qwen3": dict(family="qwen3", vocab_size=300),
    "llama": dict(family="llama", vocab_size=300),
    "qwen2_tied": dict(family="qwen2", vocab_size=300, tie_word_embeddings=True),
    "llama_rope_scaled": dict(family="llama", vocab_size=300, rope_scaling=LLAMA_SCALING),
    # HF Llama's attention_bias is on q, k, v AND o_proj; mlp_bias on gate, up and down
    "llama_attention_bias": dict(family="llama", vocab_size=300, attention_bias=True),
    "llama_mlp_bias": dict(family="llama", vocab_size=300, mlp_bias=True),
    "llama_all_biases": dict(family="llama", vocab_size=300, attention_bias=True, mlp_bias=True),
    # HF Qwen2 has q/k/v biases whatever attention_bias says (null used to read as "no biases")
    "qwen2_attention_bias_null": dict(family="qwen2", vocab_size=300, config_overrides={"attention_bias": None}),
    "qwen3_attention_bias": dict(family="qwen3", vocab_size=300, attention_bias=True),
    # 8 experts, top-2, renormalised top-k (Qwen3-30B-A3B's norm_topk_prob=true); one dense layer (mlp_only_layers)
    "qwen3_moe": dict(family="qwen3_moe", vocab_size=300, num_layers=3, mlp_only_layers=(1,)),
    "qwen3_moe_no_topk_norm": dict(family="qwen3_moe", vocab_size=300, norm_topk_prob=False, experts_per_token=3),
}
# The biases each bias case's checkpoint must hold (layer 1 shown), or its parity check proves nothing.
BIASES = {
    "llama_attention_bias": ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "llama_mlp_bias": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "llama_all_biases": ("self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"),
    "qwen2_attention_bias_null": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "qwen3_attention_bias": ("self_attn.q_proj", "self_attn.o_proj"),
}


def hf_logits(hf_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(hf_dir, ids, parallel, corrupt=None):
    chunks = build_model(hf_dir, parallel)
    load_hf(chunks, hf_dir)
    if corrupt:
        corrupt(chunks[0])
    info = chunks[0].mgrpo_info
    out = full_logits(chunks[0], ids)
    assert out.shape[-1] > info.vocab_size, "the test vocab must need padding"
    return out[..., : info.vocab_size]


def assert_close(ours, ref):
    diff = (ours - ref).abs()
    rel = diff / ref.abs().clamp_min(REL_FLOOR)
    assert diff.max() <= ABS, f"max abs diff {diff.max():.3e} > {ABS}"
    assert rel.max() <= REL, f"max rel diff {rel.max():.3e} > {REL}"
    return diff.max().item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_tp1_logits_equal_hf(case, single_rank, tiny_dirs):
    hf_dir = tiny_dirs(case, **CASES[case])
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    print(case, "max abs diff", assert_close(megatron_logits(hf_dir, ids, single_rank), hf_logits(hf_dir, ids)))


@pytest.mark.parametrize("case", sorted(BIASES))
def test_bias_cases_hold_random_biases(case, tiny_dirs):
    """The bias parity cases only catch a dropped bias if the checkpoint has non-zero ones."""
    from safetensors.torch import load_file

    tensors = load_file(f"{tiny_dirs(case, **CASES[case])}/model.safetensors")
    for module in BIASES[case]:
        assert tensors[f"model.layers.1.{module}.bias"].abs().min() > 0, module


def test_rope_scaling_matters_on_these_sequences(single_rank, tiny_dirs):
    """The scaled-rope case is only meaningful if scaling changes HF's own logits by > 1e-3."""
    scaled = tiny_dirs("llama_rope_scaled", **CASES["llama_rope_scaled"])
    plain = tiny_dirs("llama", **CASES["llama"])  # same seed, same weights, default rope
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert (hf_logits(scaled, ids) - hf_logits(plain, ids)).abs().max() > 1e-3


def _swap_gate_up(chunk):
    fc1 = chunk.decoder.layers[0].mlp.linear_fc1.weight
    with torch.no_grad():
        gate, up = fc1.detach().clone().chunk(2, 0)
        fc1.copy_(torch.cat([up, gate], 0))


def _permute_qkv_groups(chunk):
    qkv = chunk.decoder.layers[1].self_attention.linear_qkv.weight
    with torch.no_grad():
        groups = qkv.detach().clone().reshape(2, -1, qkv.shape[1])  # 2 query groups in the tiny model
        qkv.copy_(groups.flip(0).reshape_as(qkv))


@pytest.mark.parametrize("corrupt", [_swap_gate_up, _permute_qkv_groups], ids=["swap_gate_up", "permute_qkv"])
def test_corrupted_mapping_is_caught(corrupt, single_rank, tiny_dirs):
    hf_dir = tiny_dirs("qwen2", **CASES["qwen2"])
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_close(megatron_logits(hf_dir, ids, single_rank, corrupt=corrupt), hf_logits(hf_dir, ids))


def test_megatron_rope_scaling_differs_from_ours():
    """Megatron hard-codes llama3 factors (1, 4, 8192); with other values ours must differ from its formula."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mgrpo.models.builder import llama3_inv_freq
    from mgrpo.models.hf_config import RopeSpec

    spec = RopeSpec(
        theta=10000.0,
        kind="llama3",
        factor=8.0,
        low_freq_factor=2.0,
        high_freq_factor=6.0,
        original_max_position_embeddings=64,
    )
    megatron = RotaryEmbedding(
        32, 1.0, rotary_base=10000, rope_scaling=True, rope_scaling_factor=8.0, use_cpu_initialization=True
    ).inv_freq
    assert (llama3_inv_freq(spec, 32) - megatron).abs().max() > 1e-3
