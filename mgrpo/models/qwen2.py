"""Qwen2 / Qwen2.5: Llama layout plus q/k/v biases."""

from mgrpo.models.registry import Biases, Family, register_family


def qwen2_biases(raw: dict) -> Biases:
    """Qwen2Attention hard-codes bias=True on q/k/v and False on o_proj, and Qwen2MLP has none, whatever
    config.json says (its `attention_bias`, even null or false, is ignored by HF), so we ignore it too."""
    return Biases(qkv=True)


QWEN2 = register_family(
    Family(name="qwen2", architectures=("Qwen2ForCausalLM",), biases=qwen2_biases, qk_layernorm=False)
)
