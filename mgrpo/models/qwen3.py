"""Qwen3: RMSNorm on q and k per head, explicit head_dim; no biases unless attention_bias is set."""

from mgrpo.models.registry import Biases, Family, register_family


def qwen3_biases(raw: dict) -> Biases:
    """Qwen3Attention, like Llama's, puts `attention_bias` on q, k, v and o_proj; Qwen3MLP never has biases."""
    attn = bool(raw.get("attention_bias", False))
    return Biases(qkv=attn, o_proj=attn)


QWEN3 = register_family(
    Family(name="qwen3", architectures=("Qwen3ForCausalLM",), biases=qwen3_biases, qk_layernorm=True)
)
