"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, a softmax top-k router and SiLU-gated experts.

HF (transformers 5.19) computes the router in fp32: softmax over all experts, top-k, then (norm_topk_prob) divides
by the top-k sum. Renormalised top-k softmax equals a softmax over the top-k logits, so norm_topk_prob=True is
megatron's `moe_router_pre_softmax=False` and norm_topk_prob=False is `pre_softmax=True` (no renormalisation).
Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, the router as
`mlp.gate.weight`); HF fuses them to 3-D tensors only in memory. A layer is sparse unless it is listed in
`mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0`.
"""

from mgrpo.models.qwen3 import qwen3_biases
from mgrpo.models.registry import Family, ModelConfigError, MoeSpec, register_family


def qwen3_moe_spec(raw: dict) -> MoeSpec:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    topk = int(raw.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise ModelConfigError(
            f"config.json: num_experts={experts}, num_experts_per_tok={topk}: need "
            f"1 <= num_experts_per_tok <= num_experts"
        )
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    layers = int(raw["num_hidden_layers"])
    return MoeSpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def megatron_moe_kwargs(
    moe: MoeSpec,
    ep: int,
    aux_loss_coeff: float = 0.0,
    z_loss_coeff: float = 0.0,
    dispatcher: str = "auto",
    grouped_gemm: bool = False,
) -> dict:
    """TransformerConfig fields for these experts. The router runs in fp32 (as HF's does); RL turns the aux and z
    losses off unless asked. `auto` is megatron's all-to-all dispatcher (uneven token counts per rank are fine; the
    all-gather one needs every rank of the EP group to hold the same number of tokens)."""
    if dispatcher == "auto":
        dispatcher = "alltoall"
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped_gemm,
        moe_layer_freq=[int(s) for s in moe.sparse_layers],
        expert_model_parallel_size=ep,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_z_loss_coeff=z_loss_coeff or None,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_permute_fusion=False,
    )


QWEN3_MOE = register_family(
    Family(
        name="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        biases=qwen3_biases,
        qk_layernorm=True,
        moe=qwen3_moe_spec,
    )
)


def per_expert_views(params: dict) -> dict:
    """An HF model's named parameters with its in-memory fused experts (`mlp.experts.gate_up_proj` [E, 2F, H],
    `mlp.experts.down_proj` [E, H, F]) replaced by per-expert views under the checkpoint's names
    (`mlp.experts.{e}.gate_proj.weight` = gate_up_proj[e, :F], `up_proj` = [e, F:], `down_proj` = down_proj[e]),
    so a receiver of exported (checkpoint-named) weights can copy each into place."""
    out = {}
    for name, p in params.items():
        if name.endswith(".experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = p.data[e, :half]
                out[f"{base}{e}.up_proj.weight"] = p.data[e, half:]
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = p.data[e]
        else:
            out[name] = p
    return out
