"""read_model_info follows what each family's HF modeling file builds, and refuses what the builder cannot."""

import json

import pytest

from mgrpo.models.hf_config import ModelConfigError, read_model_info

BASE = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _info(tmp_path, family, **fields):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, architectures=[ARCH[family]], **fields)))
    info = read_model_info(str(tmp_path))
    return info.attention_bias, info.o_proj_bias, info.mlp_bias


@pytest.mark.parametrize(
    "family, fields, expect",
    [
        # Qwen2Attention: q/k/v bias=True and o_proj bias=False, hard-coded; attention_bias is ignored
        ("qwen2", {}, (True, False, False)),
        ("qwen2", {"attention_bias": None}, (True, False, False)),
        ("qwen2", {"attention_bias": False}, (True, False, False)),
        ("qwen2", {"mlp_bias": True}, (True, False, False)),
        # Qwen3 / Llama: attention_bias on q, k, v and o_proj; only Llama reads mlp_bias
        ("qwen3", {}, (False, False, False)),
        ("qwen3", {"attention_bias": True}, (True, True, False)),
        ("qwen3", {"mlp_bias": True}, (False, False, False)),
        ("llama", {"attention_bias": None}, (False, False, False)),
        ("llama", {"attention_bias": True}, (True, True, False)),
        ("llama", {"mlp_bias": True}, (False, False, True)),
    ],
)
def test_bias_rules_follow_hf_modeling(tmp_path, family, fields, expect):
    assert _info(tmp_path, family, **fields) == expect


@pytest.mark.parametrize("key", ["hidden_act", "hidden_activation"])
def test_non_silu_activation_is_refused(tmp_path, key):
    """The builder always makes a SiLU-gated MLP, so a gelu model would run silently as another model."""
    with pytest.raises(ModelConfigError) as err:
        _info(tmp_path, "llama", **{key: "gelu"})
    msg = str(err.value)
    assert "\n" not in msg and "config.json" in msg and f"{key}='gelu' is not supported" in msg, msg


@pytest.mark.parametrize("act", ["silu", "swish"])  # HF's ACT2FN maps both to SiLU
def test_silu_activation_is_accepted(tmp_path, act):
    _info(tmp_path, "qwen2", hidden_act=act)
