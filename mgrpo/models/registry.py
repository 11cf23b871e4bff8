"""Model families by HF architecture name; each family lives in its own small file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mgrpo.registry import Registry


class ModelConfigError(ValueError):
    """A model folder or config.json we cannot use; the message names the file and the fix. (Defined here, the
    bottom of `mgrpo.models`, so the registry and `hf_config` raise the same error without importing each other.)"""


@dataclass(frozen=True)
class Biases:
    """Which linears carry a bias: q/k/v, the attention output (o_proj), and the MLP (gate, up, down)."""

    qkv: bool = False
    o_proj: bool = False
    mlp: bool = False


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP as HF computes it (read from config.json by the family's `moe` parser)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum to 1
    sparse_layers: tuple  # per layer: True where the MLP is the MoE block, False where it is a dense MLP


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple
    # config.json -> the biases the family's HF modeling file actually builds. The modeling files disagree
    # (Qwen2 ignores attention_bias; Llama/Qwen3 put it on o_proj too), so each family states its own rule.
    biases: Callable[[dict], Biases]
    qk_layernorm: bool  # Qwen3 normalises q and k per head
    moe: Optional[Callable[[dict], MoeSpec]] = None  # config.json -> the experts (None: a dense family)


FAMILIES = Registry(
    "model family",
    builtins=("mgrpo.models.llama", "mgrpo.models.qwen2", "mgrpo.models.qwen3", "mgrpo.models.qwen3_moe"),
)


def register_family(family: Family, override: bool = False) -> Family:
    return FAMILIES.add(family.name, family, override)


def get_family(name: str) -> Family:
    return FAMILIES.lookup(name)


def family_for_architecture(arch: str, where: str = "config.json") -> Family:
    for fam in FAMILIES.values():
        if arch in fam.architectures:
            return fam
    known = sorted(a for f in FAMILIES.values() for a in f.architectures)
    raise ModelConfigError(f"{where}: architecture {arch!r} is not supported; supported: {', '.join(known)}")
