"""Read an HF `config.json` into the few facts the trainer needs, without importing transformers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from mgrpo.models.registry import ModelConfigError, MoeSpec, family_for_architecture


@dataclass
class RopeSpec:
    theta: float = 10000.0
    kind: str = "default"  # default | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelInfo:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (megatron's add_qkv_bias)
    rope: RopeSpec = field(default_factory=RopeSpec)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down (Llama mlp_bias)
    moe: Optional[MoeSpec] = None  # the experts of a mixture-of-experts family; None: every MLP is dense
    raw: dict = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer; 0 = dense."""
        return self.moe.num_experts if self.moe is not None else 0


def _rope(raw: dict, path: str) -> RopeSpec:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "llama3":
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise ModelConfigError(
        f"{path}: rope type {kind!r} is not supported (supported: default, llama3); "
        f"convert the model or add the rope type to mgrpo/models/hf_config.py"
    )


# HF's ACT2FN maps both names to SiLU, the only activation our gated MLP computes.
_SILU = ("silu", "swish")


def _check_activation(raw: dict, path: str) -> None:
    """The builder always makes a SiLU-gated MLP; any other activation would run silently as SiLU."""
    for key in ("hidden_act", "hidden_activation"):
        if key in raw and raw[key] not in _SILU:
            raise ModelConfigError(
                f"{path}: {key}={raw[key]!r} is not supported (the MLP is always SiLU-gated); "
                f'only "silu" models can be trained'
            )


def read_model_info(model_dir: str) -> ModelInfo:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelConfigError(f"{path}: not found; model.path must be an HF model folder with config.json")
    with open(path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelConfigError(f'{path}: no \'architectures\' entry; add e.g. "architectures": ["Qwen2ForCausalLM"]')
    family = family_for_architecture(archs[0], path)
    if raw.get("use_sliding_window"):
        raise ModelConfigError(f"{path}: use_sliding_window=true is not supported; set it to false")
    _check_activation(raw, path)
    biases = family.biases(raw)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelInfo(
        architecture=archs[0],
        family=family.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=biases.qkv,
        o_proj_bias=biases.o_proj,
        mlp_bias=biases.mlp,
        rope=_rope(raw, path),
        moe=family.moe(raw) if family.moe else None,
        raw=raw,
    )
