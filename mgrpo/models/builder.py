"""HF config -> megatron TransformerConfig + layer spec -> this rank's GPTModel chunks."""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from mgrpo.models.hf_config import ModelInfo, read_model_info
from mgrpo.models.registry import get_family
from mgrpo.parallel.device import device, on_cuda

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}  # float64: CPU checks


def have_transformer_engine() -> bool:
    if not on_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(
    info: ModelInfo, parallel, params_dtype: str = "float32", moe=None, te_layers: bool = False, **overrides
):
    """`moe` (config's MoeConfig; None: defaults) applies only to a model with experts; its grouped GEMM (null:
    auto) only where the layers are TE's (`te_layers`: megatron's local spec would need the `grouped_gemm`
    package). MoE-only `overrides` (the permute fusion) are dropped for a dense model."""
    from megatron.core.transformer import TransformerConfig

    family = get_family(info.family)
    dtype = _DTYPES[params_dtype]
    kwargs = dict(
        num_layers=info.num_hidden_layers,
        hidden_size=info.hidden_size,
        ffn_hidden_size=info.intermediate_size,
        num_attention_heads=info.num_attention_heads,
        num_query_groups=info.num_key_value_heads,
        kv_channels=info.head_dim,
        layernorm_epsilon=info.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=info.attention_bias,
        qk_layernorm=family.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp and parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        sequence_parallel=bool(parallel.sp),
        use_cpu_initialization=device().type == "cpu",
        perform_initialization=True,
        init_method_std=0.02,
        variable_seq_lengths=False,  # PP micro-batches share one length (see data/microbatch.py)
        batch_p2p_comm=(on_cuda() if parallel.batch_p2p_comm is None else parallel.batch_p2p_comm),
    )
    if info.moe is not None:
        from mgrpo.models.fast_paths import grouped_gemm
        from mgrpo.models.qwen3_moe import megatron_moe_kwargs

        o = moe or _default_moe()
        grouped = grouped_gemm(o.grouped_gemm, on_cuda(), te_layers)
        kwargs.update(
            megatron_moe_kwargs(info.moe, parallel.ep, o.aux_loss_coeff, o.z_loss_coeff, o.token_dispatcher, grouped)
        )
    else:
        overrides = {k: v for k, v in overrides.items() if not k.startswith("moe_")}
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _default_moe():
    from mgrpo.models.moe_options import MoeConfig

    return MoeConfig()


def _without_te_moe_gemm() -> None:
    """megatron-core 0.16.1's router GEMM tests `te_general_gemm is not None`, a name its moe_utils defines only
    when TransformerEngine imports (NameError otherwise): define it as absent so the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def layer_spec(
    config, use_te: Optional[bool] = None, experts: bool = False, packing: bool = False, fused_attention: bool = False
):
    """TE spec where TransformerEngine imports (GPU); local spec with SP-capable RMSNorm otherwise. `experts`: the
    MLP is megatron's MoE layer (config.num_moe_experts experts; a loop of experts unless moe_grouped_gemm).
    `packing`: our core attention, which keeps each sample of a packed row to itself (mgrpo/data/packing.py).
    `fused_attention` (local spec, no CP, no packing): TE's fused core attention between megatron's own linears,
    the spec LoRA trains with on a GPU (its adapters wrap those linears; local attention would keep every
    layer's score matrices: 76 GiB instead of 31 GiB per rank for Qwen2.5-72B at TP8, by --print-plan)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = have_transformer_engine()
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm) if experts else {}
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **moe)
    from mgrpo.models.norm import QKRMSNorm, SPRMSNorm

    spec = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm", **moe)
    sub = spec.submodules
    sub.input_layernorm = SPRMSNorm
    sub.pre_mlp_layernorm = SPRMSNorm
    if config.context_parallel_size > 1 or packing:  # megatron's local attention refuses CP without TE
        from mgrpo.models.cp_attention import CPDotProductAttention

        sub.self_attention.submodules.core_attention = CPDotProductAttention
    elif fused_attention:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        sub.self_attention.submodules.core_attention = TEDotProductAttention
    if config.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = QKRMSNorm
        sub.self_attention.submodules.k_layernorm = QKRMSNorm
    return spec


@functools.lru_cache(maxsize=None)
def with_bias(linear_cls: type) -> type:
    """`linear_cls`, always built with a bias whatever config.add_bias_linear says.

    Megatron's add_bias_linear puts biases on every linear (attention output and MLP alike) and add_qkv_bias
    only on qkv, but HF's Llama has o_proj biases without MLP biases (attention_bias) and vice versa
    (mlp_bias). Forcing bias=True on one spec entry gives exactly those; the linears still return the bias
    separately (skip_bias_add), and attention/MLP add it as they would with add_bias_linear: the MLP before
    its activation, the transformer layer in bias_dropout_add. Cached, so every layer shares one class.
    """

    def __init__(self, *args, **kwargs):
        kwargs["bias"] = True
        linear_cls.__init__(self, *args, **kwargs)

    return type(f"Biased{linear_cls.__name__}", (linear_cls,), {"__init__": __init__, "__module__": __name__})


def _force_bias(entry):
    """A spec entry (a class or a ModuleSpec) whose module always has a bias."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(entry, ModuleSpec):
        entry.module = with_bias(entry.module)
        return entry
    return with_bias(entry)


def add_hf_biases(spec, info: ModelInfo):
    """Give the layer spec the o_proj / MLP biases HF builds (q/k/v biases come from add_qkv_bias)."""
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    if info.o_proj_bias:
        attn.linear_proj = _force_bias(attn.linear_proj)
    if info.mlp_bias:
        mlp.linear_fc1 = _force_bias(mlp.linear_fc1)
        mlp.linear_fc2 = _force_bias(mlp.linear_fc2)
    return spec


def llama3_inv_freq(rope, head_dim: int, device=None) -> torch.Tensor:
    """Llama-3.1 frequency scaling with the config's own factors (megatron hard-codes them)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _block_spec(
    config, info: ModelInfo, vp_stage, use_te: Optional[bool] = None, packing: bool = False, fused_attention=False
):
    """This chunk's layer specs: the MoE layer where info.moe says a layer is sparse, the dense one elsewhere."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    use_te = have_transformer_engine() if use_te is None else use_te
    dense = add_hf_biases(layer_spec(config, use_te, packing=packing, fused_attention=fused_attention), info)
    if info.moe is None and use_te:
        return dense  # TE's spec brings its own final norm
    sparse = (
        layer_spec(config, use_te, experts=True, packing=packing, fused_attention=fused_attention)
        if info.moe is not None
        else None
    )
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = [sparse if info.moe is not None and info.moe.sparse_layers[first + i] else dense for i in range(n)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    from mgrpo.models.norm import SPRMSNorm

    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SPRMSNorm)


def build_model(
    model: Union[str, ModelInfo],
    parallel,
    params_dtype: str = "float32",
    make_vocab_size_divisible_by: int = 128,
    config_overrides: Optional[dict] = None,
    seed: int = 1234,
    moe=None,
    use_te: Optional[bool] = None,
    packing: bool = False,
    fused_attention: bool = False,
) -> list:
    """This rank's model chunks (one per virtual pipeline stage). Needs `setup_model_parallel` first. `moe`: the
    config's MoeConfig (a model with experts only). `use_te`: None = TransformerEngine's spec where it imports.
    `packing`: runs packed rows (train.sequence_packing; the local spec with our core attention).
    `fused_attention`: with the local spec, TE's core attention (layer_spec)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    info = read_model_info(model) if isinstance(model, str) else model
    use_te = have_transformer_engine() if use_te is None else use_te
    config = transformer_config(info, parallel, params_dtype, moe=moe, te_layers=use_te, **(config_overrides or {}))
    if info.moe is not None:
        _without_te_moe_gemm()
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else None
    vocab = padded_vocab_size(info.vocab_size, make_vocab_size_divisible_by, parallel.tp)
    torch.manual_seed(seed + mpu.get_pipeline_model_parallel_rank())
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(config, info, stage, use_te, packing, fused_attention),
            vocab_size=vocab,
            max_sequence_length=info.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=info.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=info.rope.theta,
            vp_stage=stage,
        )
        if info.rope.kind == "llama3" and getattr(chunk, "rotary_pos_emb", None) is not None:
            chunk.rotary_pos_emb.inv_freq = llama3_inv_freq(
                info.rope, info.head_dim, device=chunk.rotary_pos_emb.inv_freq.device
            )
        chunk.mgrpo_info = info  # the HF facts export/load need (vocab size, family)
        chunks.append(chunk)
    # a plan builds on meta under `with torch.device("meta")`; a run on its device
    check_placement(chunks, "meta" if torch.get_default_device().type == "meta" else device())
    return chunks


class PlacementError(RuntimeError):
    """A model tensor is not on the run's device after the build (the first forward would fail with "Expected
    all tensors to be on the same device")."""


def check_placement(chunks: list, dev: torch.device) -> None:
    """Every parameter and buffer of every chunk on `dev` (megatron-core builds on torch.cuda.current_device()
    without use_cpu_initialization and never moves a model afterwards); raises naming the first that is not."""
    dev = torch.device(dev)
    for i, chunk in enumerate(chunks):
        for kind, named in (("parameter", chunk.named_parameters()), ("buffer", chunk.named_buffers())):
            for name, t in named:
                if t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index):
                    raise PlacementError(
                        f"model chunk {i}: {kind} {name} {tuple(t.shape)} is on {t.device}, the run's device is "
                        f"{dev}; its module was built without a device (build it on "
                        f"torch.cuda.current_device() unless config.use_cpu_initialization, as megatron does)"
                    )
