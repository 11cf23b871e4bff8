"""LoRA on megatron's parallel linears, named and laid out as HF + PEFT name them.

Each HF module (q_proj, k_proj, ... down_proj) has its own A [r, in] and B [out, r], as in PEFT, even where megatron
fuses several into one linear (q/k/v into linear_qkv, gate/up into linear_fc1). Under TP each factor is split on
the base weight's axis: a column-parallel linear keeps A whole and B's rows for this rank's output shard; a
row-parallel one keeps A's columns for this rank's input shard and B whole. The adapter's output is
scaling * B (A x), added to the base linear's output; the collectives mirror the base's (SP included):

    column: u = A x  ->  copy-to-TP (SP: all-gather over sequence)  ->  B_local u, interleaved like the base output
    row:    p = A_local x_local  ->  all-reduce over TP (SP: reduce-scatter over sequence)  ->  B u

Replicated factors that see only this rank's tokens under SP (column A, row B) carry `sequence_parallel`, so
megatron's finalize_model_grads sums their gradients over TP as it does for norms. The adapter modules hang beside
their linear (`linear_qkv_lora` next to `linear_qkv`), so every base name, mapping and checkpoint key stays.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math

import torch

# HF module -> (megatron linear, kind); the order of each fused linear's parts is its output layout's order
HF_TARGETS = {
    "q_proj": ("linear_qkv", "column"),
    "k_proj": ("linear_qkv", "column"),
    "v_proj": ("linear_qkv", "column"),
    "o_proj": ("linear_proj", "row"),
    "gate_proj": ("linear_fc1", "column"),
    "up_proj": ("linear_fc1", "column"),
    "down_proj": ("linear_fc2", "row"),
}
ALL_LINEAR = tuple(HF_TARGETS)
_PARTS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_HF_PARENT = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
SUFFIX = "_lora"  # adapter module of `linear_qkv` is `linear_qkv_lora`


def lora_targets(lora) -> tuple:
    """The HF modules `model.lora.target_modules` names, in HF_TARGETS order ("all-linear": all seven)."""
    names = lora.target_modules
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else [str(n) for n in names]
    if "all-linear" in names:
        return ALL_LINEAR
    unknown = [n for n in names if n not in HF_TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown module {unknown[0]!r}" if unknown else "empty")
    return tuple(n for n in ALL_LINEAR if n in names)


def is_lora_name(name: str) -> bool:
    """True for an adapter parameter's megatron name (export, load and name maps skip them)."""
    return any(f"{linear}{SUFFIX}." in name for linear in _PARTS)


def _seeded_kaiming(shape: tuple, key: str, seed: int) -> torch.Tensor:
    """PEFT's A init (kaiming_uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), the same full tensor on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(key.encode()).hexdigest()[:12], 16))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound)


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear: `{part}_A` and `{part}_B` per HF module it fuses (absent parts add 0)."""

    def __init__(self, linear_name: str, layer: int, parts: tuple, sizes: dict, lora, info, seed: int, dtype):
        from megatron.core import parallel_state as mpu

        super().__init__()
        self.linear_name, self.layer, self.parts = linear_name, layer, parts
        self.kind = HF_TARGETS[parts[0]][1]
        self.rank, self.scaling, self.enabled = lora.rank, lora.alpha / lora.rank, True
        self.tp, self.tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.sp = False  # set by apply_lora from the model config
        self.heads = (info.num_attention_heads, info.num_key_value_heads, info.head_dim)
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        r = lora.rank
        for part in parts:
            out_full, in_full = sizes[part]
            a = _seeded_kaiming((r, in_full), f"{layer}.{part}", seed)
            if self.kind == "column":
                a_local, b_local = a, torch.zeros(out_full // self.tp, r, dtype=torch.float64)
            else:
                step = in_full // self.tp
                a_local, b_local = a[:, self.tp_rank * step : (self.tp_rank + 1) * step], torch.zeros(out_full, r)
            self.register_parameter(f"{part}_A", torch.nn.Parameter(a_local.to(dtype).contiguous()))
            self.register_parameter(f"{part}_B", torch.nn.Parameter(b_local.to(dtype).contiguous()))
        self._set_parallel_attributes()

    def _set_parallel_attributes(self) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for part in self.parts:
            a, b = getattr(self, f"{part}_A"), getattr(self, f"{part}_B")
            sharded, replicated, dim = (b, a, 0) if self.kind == "column" else (a, b, 1)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)
            set_tensor_model_parallel_attributes(replicated, False, -1, 1)
            replicated.sequence_parallel = True  # only used with config.sequence_parallel (see module docstring)

    def factor_axes(self) -> dict:
        """{param name: TP axis} of the sharded factors (checkpoints and gathers)."""
        return {f"{p}_{'B' if self.kind == 'column' else 'A'}": 0 if self.kind == "column" else 1 for p in self.parts}

    # --- forward ---
    def _arrange(self, deltas: dict) -> torch.Tensor:
        """This rank's output layout from per-part deltas (output on the last dim): megatron's QKV interleaves
        each query group's q heads, k and v; fc1 is [gate; up]. Parts without an adapter contribute zeros."""
        like = next(iter(deltas.values()))
        lead = like.shape[:-1]
        if self.linear_name == "linear_qkv":
            nh, ng, hd = self.heads
            g = ng // self.tp
            widths = {"q_proj": nh // ng * hd, "k_proj": hd, "v_proj": hd}
            pieces = [
                deltas[p].reshape(*lead, g, widths[p]) if p in deltas else like.new_zeros(*lead, g, widths[p])
                for p in ("q_proj", "k_proj", "v_proj")
            ]
            return torch.cat(pieces, -1).reshape(*lead, -1)
        if self.linear_name == "linear_fc1":
            n = next(iter(deltas.values())).shape[-1]
            return torch.cat([deltas.get(p, like.new_zeros(*lead, n)) for p in ("gate_proj", "up_proj")], -1)
        return deltas[self.parts[0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        x, r = self.dropout(x), self.rank
        a = (
            torch.cat([getattr(self, f"{p}_A") for p in self.parts])
            if len(self.parts) > 1
            else getattr(self, f"{self.parts[0]}_A")
        )
        u = x @ a.t()
        if self.kind == "column":
            u = tpl.gather_from_sequence_parallel_region(u) if self.sp else tpl.copy_to_tensor_model_parallel_region(u)
            deltas = {p: u[..., i * r : (i + 1) * r] @ getattr(self, f"{p}_B").t() for i, p in enumerate(self.parts)}
            return self._arrange(deltas) * self.scaling
        u = (
            tpl.reduce_scatter_to_sequence_parallel_region(u)
            if self.sp
            else tpl.reduce_from_tensor_model_parallel_region(u)
        )
        return (u @ getattr(self, f"{self.parts[0]}_B").t()) * self.scaling

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """scaling * B A for this rank's shard of the base weight ([out_local, in_local], its layout)."""
        deltas = {p: (getattr(self, f"{p}_B") @ getattr(self, f"{p}_A")).t() for p in self.parts}  # [in, out]
        return (self._arrange(deltas).t() * self.scaling).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Megatron dist-checkpoint entries: the sharded factor split on its TP axis, the other replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, self.factor_axes(), sharded_offsets)


@functools.lru_cache(maxsize=None)
def _with_adapter(linear_cls: type) -> type:
    """`linear_cls` whose output gains its adapter's (megatron linears return (output, bias))."""

    def forward(self, x, *args, **kwargs):
        out, bias = linear_cls.forward(self, x, *args, **kwargs)
        adapter = self.__dict__.get("_mgrpo_lora")
        if adapter is not None and adapter.enabled:
            out = out + adapter(x)
        return out, bias

    return type(f"Lora{linear_cls.__name__}", (linear_cls,), {"forward": forward, "__module__": __name__})


def hf_shapes(info) -> dict:
    """HF (out, in) of every target module."""
    h, hd, nh, ng, f = (
        info.hidden_size,
        info.head_dim,
        info.num_attention_heads,
        info.num_key_value_heads,
        info.intermediate_size,
    )
    return {
        "q_proj": (nh * hd, h),
        "k_proj": (ng * hd, h),
        "v_proj": (ng * hd, h),
        "o_proj": (h, nh * hd),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }


def _targets(layer) -> list:
    """(parent module, linear name) of a decoder layer's adaptable linears (dense MLPs only; experts are not)."""
    from megatron.core.transformer.mlp import MLP

    out = [(layer.self_attention, "linear_qkv"), (layer.self_attention, "linear_proj")]
    if isinstance(layer.mlp, MLP):
        out += [(layer.mlp, "linear_fc1"), (layer.mlp, "linear_fc2")]
    return out


def apply_lora(chunks: list, lora, seed: int) -> None:
    """Adapters on every targeted linear of every chunk; the base frozen. A and B start as PEFT's (B = 0)."""
    info = chunks[0].mgrpo_info
    sizes, wanted = hf_shapes(info), set(lora_targets(lora))
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in chunk.decoder.layers:
            for parent, name in _targets(layer):
                parts = tuple(p for p in _PARTS[name] if p in wanted)
                if not parts:
                    continue
                linear = getattr(parent, name)
                adapter = LoraAdapter(
                    name, layer.layer_number - 1, parts, sizes, lora, info, seed, linear.weight.dtype
                ).to(linear.weight.device)
                adapter.sp = bool(chunk.config.sequence_parallel)
                parent.add_module(name + SUFFIX, adapter)
                linear.__class__ = _with_adapter(type(linear))
                linear.__dict__["_mgrpo_lora"] = adapter
                linear.weight.mgrpo_lora = adapter  # the export merges through it


def adapters(chunks: list):
    """Every LoraAdapter of the chunks, in module order."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, LoraAdapter):
                yield m


def has_lora(chunks: list) -> bool:
    return next(adapters(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """The base model: the KL reference of a LoRA run (one model in memory, as ms-swift's null_ref_context)."""
    mods = list(adapters(chunks))
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


def effective_weight(param) -> torch.Tensor:
    """What the engine serves for a base parameter: the weight with its adapter folded in (this shard only)."""
    adapter = getattr(param, "mgrpo_lora", None)
    if adapter is None or not adapter.enabled:
        return param.detach()
    return param.detach() + adapter.weight_delta().to(param.dtype)


def peft_name(layer: int, part: str, factor: str) -> str:
    """PEFT's key of one factor in adapter_model.safetensors."""
    parent = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{part}.lora_{factor}.weight"


def _shard(full: torch.Tensor, adapter: LoraAdapter, name: str) -> torch.Tensor:
    """This rank's piece of a full PEFT factor."""
    axis = adapter.factor_axes().get(name)
    if axis is None or adapter.tp == 1:
        return full
    step = full.shape[axis] // adapter.tp
    return full.narrow(axis, adapter.tp_rank * step, step)


@torch.no_grad()
def load_peft_tensors(chunks: list, tensors: dict) -> None:
    """Set every adapter of the chunks from full PEFT-named factors (an adapter_model.safetensors' tensors)."""
    for ad in adapters(chunks):
        for part in ad.parts:
            for f in "AB":
                key = peft_name(ad.layer, part, f)
                if key not in tensors:
                    raise KeyError(f"LoRA tensor {key} is missing (model.lora.target_modules names {part})")
                param = getattr(ad, f"{part}_{f}")
                param.copy_(_shard(tensors[key], ad, f"{part}_{f}").to(param.dtype))


def peft_tensors(chunks: list, select=None, dense: bool = True, **_ignored):
    """(PEFT name, full factor) of this rank's chunks, in module order: sharded factors gathered over TP. Every TP
    rank must iterate (all get the full tensors). `select(param)` picks what: the value, or e.g. its main_grad.
    Takes export_hf's stream arguments (`dense=False`: this rank is no part of the export; nothing else applies)."""
    if not dense:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    select = select or (lambda p: p.detach())
    group = mpu.get_tensor_model_parallel_group()
    for ad in adapters(chunks):
        axes = ad.factor_axes()
        for part in ad.parts:
            for f in "AB":
                name = f"{part}_{f}"
                t = select(getattr(ad, name))
                if name in axes and ad.tp > 1:
                    pieces = [torch.empty_like(t) for _ in range(ad.tp)]
                    dist.all_gather(pieces, t.contiguous(), group=group)
                    t = torch.cat(pieces, axes[name])
                yield peft_name(ad.layer, part, f), t


def peft_config(lora, base_model: str = "") -> dict:
    """adapter_config.json for PEFT (and vLLM's LoRA loader)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora_targets(lora)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
        "modules_to_save": None,
    }


def trainable_count(info, lora) -> int:
    """Adapter parameters of the whole model (PEFT's count for the same targets and rank)."""
    sizes, n = hf_shapes(info), 0
    dense_layers = (
        range(info.num_hidden_layers)
        if info.moe is None
        else [g for g in range(info.num_hidden_layers) if not info.moe.sparse_layers[g]]
    )
    for part in lora_targets(lora):
        out, inp = sizes[part]
        layers = info.num_hidden_layers if HF_TARGETS[part][0] in ("linear_qkv", "linear_proj") else len(dense_layers)
        n += layers * lora.rank * (out + inp)
    return n
