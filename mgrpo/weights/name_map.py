"""Megatron parameter names -> HF names and mappings, for the Llama-like families (Qwen2, Qwen3, Llama) and
Qwen3-MoE (router and experts; megatron's expert loop `local_experts.{i}` or TE's grouped `weight{i}`).

Both megatron's local spec and its TransformerEngine spec (which fuses the norms into the next linear)
are covered. Layer indices are global: a chunk's local layer i is `layers[i].layer_number - 1`.
"""

from __future__ import annotations

import re

from mgrpo.models.lora import is_lora_name
from mgrpo.weights.mappings import QKV, Expert, GatedMLP, Mapping, Replicated, Row, Vocab

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def _ep() -> tuple:
    """(rank, size) of expert parallelism; (0, 1) before megatron's groups exist."""
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 0, 1
    return mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()


def _expert_mapping(suffix: str, g: int, info) -> Mapping | None:
    m = _EXPERT.match(suffix)
    if not m or info.moe is None:
        return None
    local, fc = (int(m.group(1)), m.group(2)) if m.group(1) is not None else (int(m.group(4)), m.group(3))
    p = f"model.layers.{g}.mlp.experts."
    if fc == "linear_fc1":

        def of(e):
            return GatedMLP((p + f"{e}.gate_proj.weight", p + f"{e}.up_proj.weight"))
    else:

        def of(e):
            return Row((p + f"{e}.down_proj.weight",))

    rank, size = _ep()
    return Expert((), of=of, local=local, per_rank=info.moe.num_experts // size, ep_rank=rank, ep_size=size)


def mlp_hf_names(g: int, info) -> set:
    """HF names of layer g's MLP: the router and every expert where the layer is sparse, gate/up/down otherwise."""
    p = f"model.layers.{g}.mlp."
    if info.moe is not None and info.moe.sparse_layers[g]:
        return {p + "gate.weight"} | {
            p + f"experts.{e}.{x}_proj.weight" for e in range(info.moe.num_experts) for x in ("gate", "up", "down")
        }
    kinds = ("weight", "bias") if info.mlp_bias else ("weight",)
    return {p + f"{x}_proj.{k}" for x in ("gate", "up", "down") for k in kinds}


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
        # a row-parallel bias is added once after the reduce, so every TP rank holds all of it
        "self_attention.linear_proj.bias": lambda: Replicated((attn + "o_proj.bias",)),
        "pre_mlp_layernorm.weight": lambda: Replicated((p + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": lambda: Replicated((p + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": lambda: GatedMLP((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
        "mlp.linear_fc1.bias": lambda: GatedMLP((p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")),
        "mlp.linear_fc2.weight": lambda: Row((p + "mlp.down_proj.weight",)),
        "mlp.linear_fc2.bias": lambda: Replicated((p + "mlp.down_proj.bias",)),
        "mlp.router.weight": lambda: Replicated((p + "mlp.gate.weight",)),
    }
    make = table.get(suffix)
    return make() if make else _expert_mapping(suffix, g, info)


def _global_mapping(name: str, info, padded_vocab: int) -> Mapping | None:
    if name == "embedding.word_embeddings.weight":
        return Vocab(("model.embed_tokens.weight",), vocab_size=info.vocab_size, padded_size=padded_vocab)
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if info.tie_word_embeddings else "lm_head.weight"
        return Vocab((hf,), vocab_size=info.vocab_size, padded_size=padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return Replicated(("model.norm.weight",))
    return None


# The non-layer parameters every model has somewhere in its pipeline.
_GLOBAL = ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight")


def mapping_for(chunk, name: str, padded_vocab: int) -> Mapping:
    """The mapping of megatron parameter `name` in `chunk` (a GPTModel)."""
    info = chunk.mgrpo_info
    mapping = _global_mapping(name, info, padded_vocab)
    if mapping is not None:
        return mapping
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        mapping = _layer_mapping(m.group(2), layer.layer_number - 1, info)
        if mapping is not None:
            return mapping
    raise KeyError(
        f"no HF mapping for megatron parameter {name!r} (family {info.family}); add it to mgrpo/weights/name_map.py"
    )


def chunk_mappings(chunk):
    """(megatron_name, parameter, mapping) for every parameter of a chunk, in module order."""
    padded = chunk.vocab_size
    for name, param in chunk.named_parameters():
        if not is_lora_name(name):  # adapters have no HF tensor of their own (models/lora.py)
            yield name, param, mapping_for(chunk, name, padded)


def consumed_hf_names(model_chunks) -> set:
    """Every HF tensor name the WHOLE model reads, on any PP stage, from this rank's chunks alone.

    A PP rank holds only some layers, so its own mappings cannot tell an unused checkpoint tensor from one
    another stage reads. All decoder layers share one attention spec, so a local layer's non-MLP parameter names,
    mapped at every global layer index, give all layers' attention and norm names; the MLP's names (dense or
    experts, layer by layer) come from config.json; the embedding, final norm and (untied) lm_head are read by
    the first or last stage, whichever stage this rank is.
    """
    info = model_chunks[0].mgrpo_info
    layer = next((layer for chunk in model_chunks for layer in chunk.decoder.layers), None)
    if layer is None:
        raise RuntimeError("consumed_hf_names: this rank holds no decoder layer to take the layer layout from")
    suffixes = [name for name, _ in layer.named_parameters() if not name.startswith("mlp.") and not is_lora_name(name)]
    names = set()
    for name in _GLOBAL:  # a tied output layer maps to embed_tokens, so lm_head is then not consumed
        names.update(_global_mapping(name, info, 0).hf_names)
    for g in range(info.num_hidden_layers):
        for suffix in suffixes:
            mapping = _layer_mapping(suffix, g, info)
            if mapping is None:
                raise KeyError(
                    f"no HF mapping for megatron layer parameter {suffix!r} (family {info.family}); "
                    f"add it to mgrpo/weights/name_map.py"
                )
            names.update(mapping.hf_names)
        names.add(f"model.layers.{g}.post_attention_layernorm.weight")  # TE fuses it into linear_fc1 (an mlp. name)
        names |= mlp_hf_names(g, info)
    return names
