"""Qwen3: no q/k/v bias, RMSNorm on q and k per head, explicit head_dim."""
from mgrpo.models.registry import Family, register_family

QWEN3 = register_family(Family(name="qwen3", architectures=("Qwen3ForCausalLM",), default_qkv_bias=False,
                               qk_layernorm=True))
