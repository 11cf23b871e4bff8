"""Llama 2/3: Llama-3.1 rope scaling (llama3 type) is applied from the config's own values."""

from mgrpo.models.registry import Biases, Family, register_family


def llama_biases(raw: dict) -> Biases:
    """LlamaAttention puts `attention_bias` on q, k, v AND o_proj; LlamaMLP puts `mlp_bias` on gate, up, down.
    HF passes the values straight to nn.Linear(bias=...), so null counts as false."""
    attn = bool(raw.get("attention_bias", False))
    return Biases(qkv=attn, o_proj=attn, mlp=bool(raw.get("mlp_bias", False)))


LLAMA = register_family(
    Family(name="llama", architectures=("LlamaForCausalLM",), biases=llama_biases, qk_layernorm=False)
)
