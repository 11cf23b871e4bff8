"""Llama 2/3: no biases; Llama-3.1 rope scaling (llama3 type) is applied from the config's own values."""
from mgrpo.models.registry import Family, register_family

LLAMA = register_family(Family(name="llama", architectures=("LlamaForCausalLM",), default_qkv_bias=False,
                               qk_layernorm=False))
