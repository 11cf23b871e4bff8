"""Megatron parameter names -> HF names and mappings, for the Llama-like families (Qwen2, Qwen3, Llama).

Both megatron's local spec and its TransformerEngine spec (which fuses the norms into the next linear)
are covered. Layer indices are global: a chunk's local layer i is `layers[i].layer_number - 1`.
"""
from __future__ import annotations

import re

from mgrpo.resharding.mappings import QKV, GatedMLP, Mapping, Replicated, Row, Vocab

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_mapping(suffix: str, g: int, info) -> Mapping | None:
    p = f"model.layers.{g}."
    attn = p + "self_attn."
    qkv = dict(num_heads=info.num_attention_heads, num_groups=info.num_key_value_heads, head_dim=info.head_dim)
    table = {
        "input_layernorm.weight": lambda: Replicated((p + "input_layernorm.weight",)),
        "self_attention.linear_qkv.layer_norm_weight": lambda: Replicated((p + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": lambda: QKV(tuple(attn + f"{x}_proj.weight" for x in "qkv"), **qkv),
        "self_attention.linear_qkv.bias": lambda: QKV(tuple(attn + f"{x}_proj.bias" for x in "qkv"), **qkv),
        "self_attention.q_layernorm.weight": lambda: Replicated((attn + "q_norm.weight",)),
        "self_attention.k_layernorm.weight": lambda: Replicated((attn + "k_norm.weight",)),
        "self_attention.linear_proj.weight": lambda: Row((attn + "o_proj.weight",)),
        "pre_mlp_layernorm.weight": lambda: Replicated((p + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": lambda: Replicated((p + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": lambda: GatedMLP((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": lambda: Row((p + "mlp.down_proj.weight",)),
    }
    make = table.get(suffix)
    return make() if make else None


def mapping_for(chunk, name: str, padded_vocab: int) -> Mapping:
    """The mapping of megatron parameter `name` in `chunk` (a GPTModel)."""
    info = chunk.mgrpo_info
    if name == "embedding.word_embeddings.weight":
        return Vocab(("model.embed_tokens.weight",), vocab_size=info.vocab_size, padded_size=padded_vocab)
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if info.tie_word_embeddings else "lm_head.weight"
        return Vocab((hf,), vocab_size=info.vocab_size, padded_size=padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return Replicated(("model.norm.weight",))
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        mapping = _layer_mapping(m.group(2), layer.layer_number - 1, info)
        if mapping is not None:
            return mapping
    raise KeyError(f"no HF mapping for megatron parameter {name!r} (family {info.family}); "
                   f"add it to mgrpo/resharding/name_map.py")


def chunk_mappings(chunk):
    """(megatron_name, parameter, mapping) for every parameter of a chunk, in module order."""
    padded = chunk.vocab_size
    for name, param in chunk.named_parameters():
        yield name, param, mapping_for(chunk, name, padded)

