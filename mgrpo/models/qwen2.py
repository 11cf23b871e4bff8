"""Qwen2 / Qwen2.5: Llama layout plus q/k/v biases."""
from mgrpo.models.registry import Family, register_family

QWEN2 = register_family(Family(name="qwen2", architectures=("Qwen2ForCausalLM",), default_qkv_bias=True,
                               qk_layernorm=False))
