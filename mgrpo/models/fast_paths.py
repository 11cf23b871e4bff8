"""Fast paths on a GPU, exact paths on CPU: megatron's fused kernels (`model.fusions`), activation recompute
(`train.recompute`) and the distributed optimizer's communication overlap (`train.overlap_grad_reduce`,
`train.overlap_param_gather`), as the TransformerConfig and DistributedDataParallelConfig fields megatron-core
0.16.1 reads.

`model.fusions: auto` turns on, where CUDA is present: the bias-SwiGLU and bias-dropout-add fusions (megatron's own
jit kernels), and where TransformerEngine imports: TE's fused RoPE (when megatron finds its kernel), the MoE
permute fusion and grouped-GEMM experts; gradient-accumulation fusion (the weight gradient accumulated into the
fp32 `main_grad` inside the GEMM) only with TE's linears and where `fused_weight_gradient_mlp_cuda` imports:
megatron's own output layer needs that kernel (`tensor_parallel/layers.py` refuses the flag without it).
Megatron-LM turns these on by default (`--no-*-fusion` flags); Megatron-Bridge gates each on the same kernels
(`megatron/bridge/utils/fusions.py`: `can_enable_apply_rope_fusion`, `can_enable_gradient_accumulation_fusion`).
Masked-softmax and persistent layer-norm fusions stay off: the TE spec's attention and norms do not use them. On
CPU every fusion is off, so the CPU path stays the exact reference.

`train.recompute`: `selective` recomputes the core attention in backward (megatron's `recompute_modules`
default, `core_attn`): the score matrices of local attention are never kept; `full` keeps only each layer's input
and recomputes the whole layer (megatron's `uniform` method, one layer per unit), the most memory it can save.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSIONS = ("auto", "off")
RECOMPUTE = ("none", "selective", "full")


def kernels() -> dict:
    """Which optional fused kernels import here: {"rope": megatron's TE RoPE, "wgrad": Apex's wgrad accumulation}."""
    out = {"rope": False, "wgrad": False}
    try:
        from megatron.core.models.common.embeddings import rope_utils

        out["rope"] = getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
    except ImportError:
        pass
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401

        out["wgrad"] = True
    except ImportError:
        pass
    return out


def fusion_overrides(mode: str, cuda: bool, te: bool, te_linears: bool, moe: bool, found: dict) -> dict:
    """TransformerConfig fields for `model.fusions` (`te`: TransformerEngine imports; `te_linears`: the layers are
    TE's, not megatron's own; `found`: `kernels()`)."""
    on = mode == "auto" and cuda
    out = dict(
        bias_activation_fusion=on,
        bias_dropout_fusion=on,
        apply_rope_fusion=on and te and found["rope"],
        gradient_accumulation_fusion=on and te and te_linears and found["wgrad"],
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    if moe:
        out.update(moe_permute_fusion=on and te)
    return out


def grouped_gemm(setting, cuda: bool, te: bool) -> bool:
    """`model.moe.grouped_gemm`: null follows the fusions (TE's grouped GEMM on a GPU), true/false as given."""
    return bool(cuda and te) if setting is None else bool(setting)


def recompute_overrides(mode: str) -> dict:
    """TransformerConfig fields for `train.recompute`."""
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if mode == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def overlap_settings(train, cuda: bool) -> dict:
    """DistributedDataParallelConfig fields: each overlap on by default with the distributed optimizer on a GPU
    (null), as given otherwise; the parameter all-gather overlaps only with the distributed optimizer."""
    default = bool(cuda and train.use_distributed_optimizer)
    grad = default if train.overlap_grad_reduce is None else bool(train.overlap_grad_reduce)
    param = default if train.overlap_param_gather is None else bool(train.overlap_param_gather)
    return dict(overlap_grad_reduce=grad, overlap_param_gather=param and train.use_distributed_optimizer)


@dataclass(frozen=True)
class AttentionChoice:
    """The layers a run builds. `te_spec`: TE's whole layer spec (its linears, norms and core attention);
    `fused`: TE's fused core attention (no score matrices kept: what --print-plan's `flash` counts); `thd`: packed
    rows run as TE's THD format, one sequence per sample (megatron's `PackedSeqParams`, data/packing.thd_params)."""

    te_spec: bool
    fused: bool
    thd: bool


def attention_choice(lora: bool, packing: bool, cp: int, te: bool) -> AttentionChoice:
    """Without TE (CPU): megatron's local spec, packed rows through our core attention. With TE: LoRA keeps
    megatron's own linears (its adapters wrap them) around TE's core attention, everything else takes TE's spec;
    packed rows go to TE as THD (TE's cuDNN/flash varlen kernels, as Megatron-LM's `--packed-seq` datasets do).
    At CP > 1 packing and LoRA stay on our core attention: TE's THD context parallelism splits each sequence into
    2 x CP chunks (`thd_get_partitioned_indices`), our packed rows split the whole row (data/packing.py), and LoRA's
    local spec has no CP attention of megatron's own."""
    if not te or (cp > 1 and (packing or lora)):
        return AttentionChoice(te_spec=False, fused=False, thd=False)
    return AttentionChoice(te_spec=not lora, fused=True, thd=packing)
