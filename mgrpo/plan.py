"""`--print-plan`: what a launch would do, without loading weights or touching a GPU. The parallel layout (which
global ranks form each TP/PP/DP/CP group, and with experts each EP and expert-DP group, by megatron's own
RankGenerators and order), the batch arithmetic, parameters per rank and a per-rank memory estimate, then exit 0.

Parameters are counted on the model megatron itself builds for each pipeline stage, on the `meta` device, under
torch's fake process group (every rank of a 16-rank plan in one process, in seconds). "Unique" parameters are the
ones a rank is the owner of: its TP shard of sharded weights without vocabulary padding, replicated weights (norms)
on TP rank 0 only, nothing on DP/CP replicas, nothing for a tied output layer's copy on the last stage; summed over
ranks they equal the HF model's count. Expert weights have their own owners: megatron replicates them over the
expert-data-parallel group (world / (expert-TP x EP x PP) ranks, not DP x CP), so expert-DP rank 0 owns them; each
EP rank holds (and owns) a different block of E / EP experts, and expert-TP shards them as TP shards dense weights.

The memory estimate (`memory_estimate`) is per rank, in bytes: weights, gradients (megatron's fp32 grad buffer),
Adam state (with and without the distributed optimizer, which shards expert state over expert-DP), activations of
the micro-batches a pipeline stage holds at once (1F1B) at the configured micro-batch and sequence length plus one
layer's backward working set (MoE layers: a rough estimate), the logits with the fused kernel, and a fixed runtime
overhead. Checked against measured peak RSS on CPU by benchmarks/memory_plan.py (the working-set and overhead
terms were added after its first run: calibrated there; dense models only).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

GiB = 1 << 30


@dataclass
class StageParams:
    """One pipeline rank's parameters as built (TP rank 0 stands for its TP group: same shapes)."""

    held: int = 0  # on this rank, vocabulary padding included (what memory holds)
    sharded: int = 0  # TP-sharded, padding excluded, this rank's share
    replicated: int = 0  # same on every TP rank (norms); counted once per TP group
    tied_copy: int = 0  # the last stage's copy of a tied embedding (PP > 1)
    vocab_rows: list = field(default_factory=list)  # (local rows, hidden) of each vocab-parallel matrix
    layers: int = 0
    layer_numbers: list = field(default_factory=list)  # megatron's 1-based global numbers of the layers built here
    expert_held: int = 0  # expert weights on this rank (its E / EP experts, its expert-TP shard); part of `held`
    expert_sharded: int = 0  # the expert-TP-sharded part of expert_held
    expert_replicated: int = 0  # same on every expert-TP rank; counted once per expert-TP group
    lora_held: int = 0  # LoRA adapter parameters on this rank (trainable; the rest is frozen); part of `held`
    lora_sharded: int = 0  # the TP-sharded factors among them (column B, row A)


def rank_groups(tp: int, pp: int, cp: int, dp: int, ep: int = 1) -> dict:
    """{'tp'|'pp'|'dp'|'cp'|'dp-cp'|'ep'|'expert-tp'|'expert-dp': [[global ranks], ...]} exactly as megatron's
    initialize_model_parallel forms them: one RankGenerator (order tp-cp-ep-dp-pp, ep=1) for the dense part, a
    second for the experts (same order, cp=1, tp = expert-TP = TP, dp = expert-DP = world / (TP x EP x PP))."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    out = {k: gen.get_ranks(k) for k in ("tp", "pp", "dp", "cp", "dp-cp")}
    expert = RankGenerator(tp=tp, ep=ep, dp=tp * pp * cp * dp // (tp * ep * pp), pp=pp, cp=1, order=order)
    out.update({"ep": expert.get_ranks("ep"), "expert-tp": expert.get_ranks("tp"), "expert-dp": expert.get_ranks("dp")})
    return out


AXES = ("pp", "tp", "dp", "cp", "ep", "expert-dp")


def coords(groups: dict, world: int) -> list:
    """[(pp, tp, dp, cp, ep, expert-dp) rank of every global rank] (expert-TP rank = TP rank: the same groups)."""
    out = [[0] * len(AXES) for _ in range(world)]
    for axis, name in enumerate(AXES):
        for group in groups[name]:
            for i, r in enumerate(group):
                out[r][axis] = i
    return [tuple(c) for c in out]


INIT_METHODS = ("init_method", "output_layer_init_method", "embedding_init_method")


def _no_init(tensor):
    """The plan's init method: a meta tensor has no values to draw. Drawing them anyway, through megatron's CPU
    initialization (a normal_ per weight and expert, each through torch's function modes), took a quarter of the
    plan test's builds (13 layouts up to qwen3-235b-a22b: 16.6 s with it, 12.1 s without, the same counts)."""
    return tensor


def stage_params(cfg, model_dir: str, world: int, rank: int) -> StageParams:
    """Build `rank`'s chunks on meta under a fake process group of `world` ranks; count their parameters."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mgrpo.models.builder import build_model
    from mgrpo.models.lora import is_lora_name
    from mgrpo.parallel.cpu_shims import apply_cpu_shims
    from mgrpo.parallel.pipeline import unwrap

    if dist.is_initialized():
        raise RuntimeError(
            "the plan builds under its own fake process group: run it in a process that has none "
            "(launch/train_grpo.py --print-plan)"
        )
    apply_cpu_shims()  # megatron asks for CUDA RNG state and devices while building; none is touched
    p = cfg.parallel
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp if p.vpp and p.vpp > 1 else None,
            context_parallel_size=p.cp,
            expert_model_parallel_size=p.ep,
            create_gloo_process_groups=False,
        )
        with torch.device("meta"):
            chunks = build_model(
                model_dir,
                p,
                cfg.model.params_dtype,
                cfg.model.make_vocab_size_divisible_by,
                seed=cfg.train.seed,
                moe=cfg.model.moe,
                use_te=False if cfg.model.lora.rank else None,
                config_overrides=dict.fromkeys(INIT_METHODS, _no_init),  # meta tensors hold no values
            )
            if cfg.model.lora.rank:
                from mgrpo.models.lora import apply_lora

                apply_lora(chunks, cfg.model.lora, cfg.train.seed)
        out = StageParams()
        for chunk in chunks:
            model = unwrap(chunk)
            out.layers += len(model.decoder.layers)
            out.layer_numbers += [layer.layer_number for layer in model.decoder.layers]
            for name, param in model.named_parameters():
                n = param.numel()
                out.held += n
                if is_lora_name(name):
                    out.lora_held += n
                    out.lora_sharded += n if getattr(param, "tensor_model_parallel", False) else 0
                elif is_expert_param(name, param):
                    out.expert_held += n
                    if getattr(param, "tensor_model_parallel", False):
                        out.expert_sharded += n
                    else:
                        out.expert_replicated += n
                elif (
                    name == "output_layer.weight"
                    and model.share_embeddings_and_output_weights
                    and not model.pre_process
                ):
                    out.tied_copy += n
                elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    out.vocab_rows.append((param.shape[0], param.shape[1]))
                elif getattr(param, "tensor_model_parallel", False):
                    out.sharded += n
                else:
                    out.replicated += n
        return out
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def is_expert_param(name: str, param) -> bool:
    """Megatron marks expert weights `allreduce=False` (DDP and the optimizer put them in their expert-DP buffers)
    only when EP > 1; at EP 1 they are plain DP weights (expert-DP = DP x CP then), known by their module name."""
    return not getattr(param, "allreduce", True) or ".mlp.experts." in name


def lora_unique(stage: StageParams, tp_rank: int, dp_rank: int, cp_rank: int) -> int:
    """The adapter parameters this rank owns: sharded factors on DP0/CP0, replicated ones on TP0 of those."""
    if dp_rank or cp_rank:
        return 0
    return stage.lora_sharded + (stage.lora_held - stage.lora_sharded if tp_rank == 0 else 0)


def vocab_share(local_rows: int, tp_rank: int, vocab: int) -> int:
    """Rows of a vocab-parallel shard that are real tokens (the padding sits at the end of the last shards)."""
    start = tp_rank * local_rows
    return max(0, min(vocab, start + local_rows) - start)


def unique_params(
    stage: StageParams, tp_rank: int, dp_rank: int, cp_rank: int, vocab: int, expert_dp_rank: int = 0
) -> int:
    """What this rank owns: dense weights on DP0/CP0 (replicated ones on TP0 too), experts on expert-DP rank 0."""
    experts = 0 if expert_dp_rank else stage.expert_sharded + (stage.expert_replicated if tp_rank == 0 else 0)
    if dp_rank or cp_rank:
        return experts
    rows = sum(vocab_share(r, tp_rank, vocab) * h for r, h in stage.vocab_rows)
    return (
        stage.sharded
        + rows
        + (stage.replicated if tp_rank == 0 else 0)
        + experts
        + lora_unique(stage, tp_rank, dp_rank, cp_rank)
    )


def plan_seq_len(cfg) -> int:
    """Tokens per sample the estimate assumes: the longest prompt allowed (data.max_prompt_length, else 512)
    plus rollout.max_tokens."""
    return (cfg.data.max_prompt_length or 512) + cfg.rollout.max_tokens


ATTENTION = {
    "flash": "fused attention (TE/flash on GPU): no score matrix kept",
    "local": "megatron's local attention (packing or LoRA at CP > 1, CPU): fp32 scores and probabilities kept",
}


def built_attention(cfg) -> str:
    """The attention the run builds on a GPU with TransformerEngine: the actor's own choice
    (models/fast_paths.attention_choice): TE's fused attention, packed rows as THD, except packing and LoRA at
    CP > 1, which run our core attention on megatron's local spec and keep the score matrices."""
    from mgrpo.models.fast_paths import attention_choice

    lora = cfg.model.lora.rank > 0
    return "flash" if attention_choice(lora, cfg.train.sequence_packing, cfg.parallel.cp, te=True).fused else "local"


def activation_bytes_per_layer(
    info, p, tokens: int, seq: int, elem: int, attention: str = "flash", sparse: bool = False
) -> float:
    """Tensors one transformer layer keeps for backward (no recomputation), for `tokens` tokens of sequences of
    length `seq` on this rank (CP: seq is the full length, the rank holds seq / cp queries).

    `sparse` (a MoE layer): a rough estimate, not measured. After the all-to-all over EP and the all-gather over
    expert-TP a rank computes topk x tokens routed tokens on average (routing imbalance moves it; nothing is
    dropped): each keeps its permuted input (h) and its expert MLP's 3 x moe_ffn / expert-TP, instead of the dense
    3 x ffn / TP per token; plus the router's fp32 scores and probabilities (2 x E per token)."""
    h, d, a, kv, ffn = (
        info.hidden_size,
        info.head_dim,
        info.num_attention_heads,
        info.num_key_value_heads,
        info.intermediate_size,
    )
    t = p.tp
    sp = t if p.sp else 1  # sequence parallel shards the norms' and residuals' tokens over TP
    if sparse:  # expert-TP = TP (megatron's default)
        m = info.moe
        mlp, router = m.topk * (h + 3 * m.ffn_hidden_size / t), 4 * 2 * m.num_experts / sp
    else:
        mlp, router = 3 * ffn / t, 0.0
    per_token = elem * (6 * h / sp + (2 * a + 3 * kv) * d / t + mlp) + router
    if attention == "local":  # softmax in fp32: scores and probabilities per query token and head
        scores = 4 * 2 * (a / t) * seq
    else:  # flash attention keeps the softmax statistics only
        scores = 4 * (a / t)
    return tokens * (per_token + scores)


def backward_working_set(info, p, tokens: int, seq: int, attention: str, sparse: bool = False) -> float:
    """What one layer's backward allocates on top of the saved tensors: with local attention the gradients of the
    scores and probabilities and the recomputed mask (about three score matrices); with flash attention about one
    layer's activations (a MoE layer's where the stage has one)."""
    if attention == "local":
        return 3 * 4 * (info.num_attention_heads / p.tp) * seq * tokens
    return activation_bytes_per_layer(info, p, tokens, seq, 2, attention, sparse)


def sparse_count(info, stage: StageParams) -> int:
    """How many of the stage's layers are MoE layers (info.moe.sparse_layers, by megatron's global layer number)."""
    if info.moe is None:
        return 0
    return sum(1 for n in stage.layer_numbers if info.moe.sparse_layers[n - 1])


RUNTIME_OVERHEAD = 128 << 20  # allocator caching, communication buffers, thread stacks: about 100-200 MB per rank
# on the CPU machines here (benchmarks/memory_plan.py); on a GPU add the CUDA context (~0.5 GB, outside torch)


def memory_estimate(
    cfg,
    info,
    stage: StageParams,
    pp_rank: int,
    dp: int,
    vocab_padded: int,
    attention: str = "flash",
    expert_dp: int | None = None,
) -> dict:
    """Bytes per rank: weights, grads, optimizer (plain and distributed), activations, logits, total. The rank
    holds its E / EP experts' weights, fp32 gradients and Adam state like any other; megatron's distributed
    optimizer shards dense state over DP x CP and expert state over `expert_dp` (its intra expert-DP group).
    With LoRA only the adapters have gradients and Adam state (the frozen base has neither)."""
    p, t = cfg.parallel, cfg.train
    elem = 2 if cfg.model.params_dtype == "bfloat16" else 4
    held = stage.held
    weights = held * elem
    trained = stage.lora_held if stage.lora_held else held
    expert_trained = 0 if stage.lora_held else stage.expert_held
    grads = trained * 4  # DDP grad buffer in fp32 (grad_reduce_in_fp32)
    per_param = 8 + (4 if elem == 2 else 0)  # m, v (+ fp32 master weights with bf16)
    adam = trained * per_param
    expert_dp = expert_dp or dp * p.cp
    adam_dist = (trained - expert_trained) * per_param / (dp * p.cp) + expert_trained * per_param / expert_dp
    seq = plan_seq_len(cfg)
    per_dp = max(1, cfg.rollout.prompts_per_step * cfg.rollout.n // max(t.steps_per_generation, 1) // dp)
    mbs = min(t.micro_batch_size, per_dp)
    micro_batches = math.ceil(per_dp / mbs)
    inflight = min(p.pp - pp_rank, micro_batches) if p.pp > 1 else 1  # 1F1B warm-up depth
    if p.vpp and p.vpp > 1:
        inflight = min(micro_batches * p.vpp, inflight * p.vpp)  # interleaved: more chunks in flight
    tokens = mbs * seq / p.cp
    sparse = sparse_count(info, stage)
    kept = "flash" if t.recompute == "selective" else attention  # selective: core attention recomputed, no scores
    layers_act = activation_bytes_per_layer(info, p, tokens, seq, elem, kept) * (stage.layers - sparse)
    if sparse:
        layers_act += activation_bytes_per_layer(info, p, tokens, seq, elem, kept, True) * sparse
    if t.recompute == "full":  # each layer keeps its input only; one layer's activations come back in backward
        layers_act = tokens * info.hidden_size / (p.tp if p.sp else 1) * elem * stage.layers
    layers_act /= p.vpp or 1
    working = backward_working_set(info, p, tokens, seq, attention, sparse > 0)
    if t.recompute == "full":  # the recomputed layer's activations, then its backward's
        working += activation_bytes_per_layer(info, p, tokens, seq, elem, attention, sparse > 0)
    activations = layers_act * inflight + working
    last = pp_rank == p.pp - 1
    # logits [mbs, seq/cp, V/tp] in the model dtype, kept for backward, plus their fp32 gradient while it runs
    logits = tokens * vocab_padded / p.tp * (elem + 4) if last else 0.0
    optimizer = adam_dist if t.use_distributed_optimizer else adam
    total = weights + grads + optimizer + activations + logits + RUNTIME_OVERHEAD
    return dict(
        weights=weights,
        grads=grads,
        optimizer=adam,
        optimizer_distributed=adam_dist,
        activations=activations,
        logits=logits,
        overhead=RUNTIME_OVERHEAD,
        total=total,
        seq=seq,
        micro_batch=mbs,
        micro_batches=micro_batches,
        inflight=inflight,
    )


def build_plan(cfg, world: int, attention: str = "flash") -> dict:
    """Everything print_plan prints, as data (tests read it)."""
    from mgrpo.models.builder import padded_vocab_size
    from mgrpo.models.hf_config import read_model_info

    p = cfg.parallel
    info = read_model_info(cfg.model.path)
    mp = p.tp * p.pp * p.cp
    dp = world // mp
    expert_dp = world // (p.tp * p.ep * p.pp)
    groups = rank_groups(p.tp, p.pp, p.cp, dp, p.ep)
    where = coords(groups, world)
    stages = {}
    for stage in range(p.pp):  # every rank of a stage holds the same shapes (EP ranks: as many experts)
        rank = next(r for r, c in enumerate(where) if c[:4] == (stage, 0, 0, 0))
        stages[stage] = stage_params(cfg, cfg.model.path, world, rank)
    vocab_padded = padded_vocab_size(info.vocab_size, cfg.model.make_vocab_size_divisible_by, p.tp)
    ranks = []
    for r, (pp_rank, tp_rank, dp_rank, cp_rank, ep_rank, edp_rank) in enumerate(where):
        s = stages[pp_rank]
        ranks.append(
            dict(
                rank=r,
                pp=pp_rank,
                tp=tp_rank,
                dp=dp_rank,
                cp=cp_rank,
                ep=ep_rank,
                edp=edp_rank,
                held=s.held,
                expert_held=s.expert_held,
                lora_unique=lora_unique(s, tp_rank, dp_rank, cp_rank),
                unique=unique_params(s, tp_rank, dp_rank, cp_rank, info.vocab_size, edp_rank),
                memory=memory_estimate(cfg, info, s, pp_rank, dp, vocab_padded, attention, expert_dp),
            )
        )
    return dict(
        world=world,
        dp=dp,
        expert_dp=expert_dp,
        groups=groups,
        ranks=ranks,
        info=info,
        vocab_padded=vocab_padded,
        attention=attention,
        unique_total=sum(r["unique"] for r in ranks),
        trainable=sum(r["lora_unique"] for r in ranks) if cfg.model.lora.rank else None,
        unique_experts=p.ep * sum(s.expert_sharded * p.tp + s.expert_replicated for s in stages.values()),
    )


def _groups_line(name: str, groups: list, limit: int = 4) -> str:
    shown = ", ".join(_ranks(g) for g in groups[:limit])
    more = f", ... ({len(groups)} groups)" if len(groups) > limit else ""
    return f"  {name:6} {len(groups)} x {len(groups[0])}: {shown}{more}"


def _ranks(g: list) -> str:
    if len(g) > 2 and g == list(range(g[0], g[0] + len(g))):
        return f"[{g[0]}-{g[-1]}]"
    return "[" + ",".join(map(str, g)) + "]"


def format_plan(cfg, plan: dict) -> str:
    from mgrpo.models.lora import lora_targets

    p, t, r = cfg.parallel, cfg.train, cfg.rollout
    info, world, dp = plan["info"], plan["world"], plan["dp"]
    moe = info.moe is not None
    m0 = plan["ranks"][0]["memory"]
    opt_steps = t.steps_per_generation * t.num_iterations
    gb = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
    experts = f"; experts: expert-TP {p.tp} x EP {p.ep} x expert-DP {plan['expert_dp']} x PP {p.pp}" if moe else ""
    lines = [
        f"plan: {os.path.basename(os.path.normpath(cfg.model.path))} ({info.family}, {info.num_hidden_layers} "
        f"layers, hidden {info.hidden_size}, vocab {info.vocab_size} padded to {plan['vocab_padded']}) on "
        f"{world} ranks, {cfg.model.params_dtype}",
        f"layout: TP {p.tp} x PP {p.pp}{f' (VPP {p.vpp})' if p.vpp and p.vpp > 1 else ''} x CP {p.cp} x DP {dp}"
        f"{', SP' if p.sp else ''} (megatron order tp-cp-ep-dp-pp){experts}",
    ]
    for name in ("tp", "pp", "cp", "dp"):
        lines.append(_groups_line(name.upper(), plan["groups"][name]))
    if p.ep > 1:
        lines += [_groups_line("EP", plan["groups"]["ep"]), _groups_line("EXP-DP", plan["groups"]["expert-dp"])]
    if moe:
        m = info.moe
        lines.append(
            f"experts: {m.num_experts} per MoE layer ({sum(m.sparse_layers)} of {info.num_hidden_layers} "
            f"layers), top-{m.topk}, expert FFN {m.ffn_hidden_size}; {m.num_experts // p.ep} per EP rank "
            f"(EP {p.ep}), expert-TP {p.tp} (= TP), expert-DP {plan['expert_dp']}"
        )
    samples = r.prompts_per_step * r.n
    per_dp = samples // max(t.steps_per_generation, 1) // dp
    held = f"{'expert held':>14} {'non-expert held':>15}" if moe else f"{'params held':>14}"
    lines += [
        f"batch: {r.prompts_per_step} prompts x {r.n} samples = {samples} per rollout step; "
        f"{t.steps_per_generation} mini-batch(es) x {t.num_iterations} iteration(s) = {opt_steps} optimizer "
        f"step(s) per rollout step, {opt_steps * t.steps} in {t.steps} steps",
        f"       per DP rank: {per_dp} samples per mini-batch = {m0['micro_batches']} micro-batch(es) of "
        f"{m0['micro_batch']}; up to {m0['seq']} tokens per sample (data.max_prompt_length or 512, + "
        f"rollout.max_tokens {r.max_tokens})",
        f"params: {plan['unique_total']:,} unique over all ranks (HF count; vocabulary padding and replicas "
        f"excluded)" + (f"; {plan['unique_experts']:,} of them in experts" if moe else ""),
    ]
    if plan["trainable"] is not None:
        lo = cfg.model.lora
        lines.append(
            f"lora: rank {lo.rank}, alpha {lo.alpha:g} on {', '.join(lora_targets(lo))}: "
            f"{plan['trainable']:,} trainable (PEFT's count), {plan['unique_total'] - plan['trainable']:,} "
            f"frozen; gradients and Adam state for the adapters only"
        )
    lines += [
        f"memory per rank, GiB (estimate; Adam; activations of the micro-batches a stage holds at once, "
        f"{ATTENTION[plan['attention']]}: --plan-attention; train.recompute {t.recompute}"
        + ("; adam/dist: dense state sharded over DP x CP, expert state over expert-DP" if moe else "")
        + "):",
        f"  {'rank':>4} {'pp':>3} {'tp':>3} {'dp':>3} {'cp':>3} "
        + (f"{'ep':>3} {'edp':>3} " if moe else "")
        + f"{held} {'unique':>14} "
        f"{'weights':>8} {'grads':>8} {'adam':>8} {'adam/dist':>9} {'activ.':>8} {'logits':>8} {'total':>8}",
    ]
    rows = plan["ranks"]
    if world > 32:  # one row per (pp, tp) class of the first replica
        rows = [x for x in rows if x["dp"] == 0 and x["cp"] == 0]
    for x in rows:
        m = x["memory"]
        where = f"{x['rank']:>4} {x['pp']:>3} {x['tp']:>3} {x['dp']:>3} {x['cp']:>3}"
        if moe:
            where += f" {x['ep']:>3} {x['edp']:>3} {x['expert_held']:>14,} {x['held'] - x['expert_held']:>15,}"
        else:
            where += f" {x['held']:>14,}"
        lines.append(
            f"  {where} {x['unique']:>14,} {gb(m['weights'])} {gb(m['grads'])} {gb(m['optimizer'])} "
            f"{gb(m['optimizer_distributed']):>9} {gb(m['activations'])} {gb(m['logits'])} "
            f"{gb(m['total'])}"
        )
    peak = max(plan["ranks"], key=lambda x: x["memory"]["total"])
    colocated = cfg.rollout.engine == "vllm"
    lines.append(
        f"largest: rank {peak['rank']} (pp {peak['pp']}) {peak['memory']['total'] / GiB:.2f} GiB "
        f"({'with' if t.use_distributed_optimizer else 'without'} the distributed optimizer, as configured)"
        + ("" if colocated else "; rollout engines not included")
    )
    lines += weight_sync_lines(cfg, plan)
    if colocated:
        from mgrpo.plan_gpu import GPU_GIB, engine_map, format_gpu_plan
        from mgrpo.rollout.placement import PlacementError, describe

        try:
            devices, hosts = engine_map(cfg, plan)
        except PlacementError as exc:
            lines.append(f"engines: cannot be placed: {exc}")
        else:
            lines.append(describe(devices, hosts, "vllm") + " (8 GPUs per node, every GPU visible to each rank)")
            lines += format_gpu_plan(cfg, plan, GPU_GIB[plan.get("gpu", "h100")])
    return "\n".join(lines)


def weight_sync_lines(cfg, plan: dict) -> list:
    """What one weight version costs on the wire and, with rollout.remote.delta, the delta bases' host memory."""
    r = cfg.rollout
    transport = r.remote.transport
    if (
        r.engine != "remote"
        or transport not in ("http", "collective")
        or (cfg.model.lora.rank > 0 and r.lora_sync == "adapter")
    ):
        return []
    width = 2 if cfg.model.params_dtype == "bfloat16" else 4
    wire = plan["unique_total"] * width
    stages = [sum(x["unique"] for x in plan["ranks"] if x["pp"] == s) * width for s in range(cfg.parallel.pp)]
    how = "sent by rank 0" if transport == "http" else f"one sender per PP stage, largest {max(stages) / GiB:.1f} GiB"
    line = (
        f"weight sync ({transport.replace('http', 'HTTP')}, {r.update_bucket_mb} MB buckets, {how}): "
        f"{wire / GiB:.1f} GiB per version to each of {len(r.servers)} server(s)"
    )
    if not r.remote.delta:
        return [line + "; rollout.remote.delta: true sends what changed (see docs/weight-sync.md#deltas)"]
    if transport == "http":
        keeps = (
            f"the sender (rank 0) keeps {wire / GiB:.1f} GiB of host memory (its last version, "
            f"{cfg.model.params_dtype}); each server keeps {wire / GiB:.1f} GiB in /dev/shm (the version it loaded; "
            f"twice that while a delta loads)"
        )
    else:
        keeps = (
            f"each stage sender keeps its own stage's last version in host memory "
            f"({', '.join(f'{b / GiB:.1f}' for b in stages)} GiB for stages 0..{len(stages) - 1}, "
            f"{cfg.model.params_dtype}); each server keeps {wire / GiB:.1f} GiB on its first worker (the version it "
            f"loaded; the first worker decodes and shares each tensor with the others)"
        )
    return [
        line + " on a full push; deltas send what changed (~3-5% of it at LR 1e-6 on the ~85M model measured here)",
        f"delta base (rollout.remote.delta): {keeps}",
    ]


def take_plan_flags(argv: list) -> tuple:
    """(argv without the plan's flags, {"print": --print-plan given, "world": --world-size N or None,
    "attention": --plan-attention flash|local (None: the one the run builds), "gpu": --plan-gpu h100|h200})."""
    from mgrpo.config import ConfigError
    from mgrpo.plan_gpu import GPU_GIB

    out, opts, i = [], {"print": False, "world": None, "attention": None, "gpu": "h100"}, 0
    while i < len(argv):
        arg, key = argv[i], argv[i].split("=", 1)[0]
        if arg == "--print-plan":
            opts["print"] = True
        elif key in ("--world-size", "--plan-attention", "--plan-gpu"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if key == "--world-size":
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError([f"--world-size {value!r}: give the number of ranks, e.g. --world-size 16"])
                opts["world"] = int(value)
            elif key == "--plan-gpu":
                if value not in GPU_GIB:
                    raise ConfigError([f"--plan-gpu {value!r}: use one of {', '.join(GPU_GIB)}"])
                opts["gpu"] = value
            elif value not in ATTENTION:
                raise ConfigError([f"--plan-attention {value!r}: use one of {', '.join(ATTENTION)}"])
            else:
                opts["attention"] = value
        else:
            out.append(arg)
        i += 1
    return out, opts


def print_plan(argv: list, world: int | None, attention: str | None = None, gpu: str = "h100") -> None:
    """The plan for `world` ranks (default: WORLD_SIZE from the launcher, else TP x PP x CP) on `gpu`s, with the
    attention the run builds unless `attention` names one; raises ConfigError or ModelConfigError with the same
    one-line errors as a real launch."""
    from mgrpo.config import ConfigError, load_config
    from mgrpo.layout_checks import validate_layout
    from mgrpo.models.hf_config import read_model_info

    cfg = load_config(argv=argv, check_files=False)
    info = read_model_info(cfg.model.path)
    p = cfg.parallel
    world = world or int(os.environ.get("WORLD_SIZE", 0)) or p.tp * p.pp * p.cp
    errors = validate_layout(cfg, info, world, cuda=True)  # the plan is for the GPU job
    if errors:
        raise ConfigError(errors)
    plan = build_plan(cfg, world, attention or built_attention(cfg))
    plan["gpu"] = gpu
    print(format_plan(cfg, plan), flush=True)


def cpu_memory_problem(cfg, info, local_ranks: int) -> str | None:
    """Without CUDA: one line when the ranks on this machine cannot hold their weights, gradients and Adam state
    in its memory (a 72B config started on a laptop), instead of an out-of-memory kill minutes later."""
    import psutil

    p, m = cfg.parallel, info.moe
    h, d, L, f = info.hidden_size, info.head_dim, info.num_hidden_layers, info.intermediate_size
    sparse = sum(m.sparse_layers) if m else 0  # MoE layers: a router instead of the dense MLP, experts over EP
    layer = h * d * (2 * info.num_attention_heads + 2 * info.num_key_value_heads) + 2 * h
    dense = (
        info.vocab_size * h * (1 if info.tie_word_embeddings else 2)
        + L * layer
        + (L - sparse) * 3 * h * f
        + h
        + (sparse * m.num_experts * h if m else 0)
    )
    experts = sparse * m.num_experts * 3 * h * m.ffn_hidden_size if m else 0
    total = dense + experts
    bf16 = cfg.model.params_dtype == "bfloat16"
    trained = 0 if cfg.model.lora.rank else (4 + 8 + (4 if bf16 else 0))  # grads, Adam (LoRA: the adapters' only)
    per_rank = (dense / (p.tp * p.pp) + experts / (p.tp * p.ep * p.pp)) * ((2 if bf16 else 4) + trained)
    need, have = per_rank * local_ranks, psutil.virtual_memory().total
    if need <= have:
        return None
    ep = f" x EP{p.ep}" if p.ep > 1 else ""
    return (
        f"no GPU here, and model.path={cfg.model.path!r} ({total / 1e9:.1f}B parameters) at TP{p.tp} x "
        f"PP{p.pp}{ep} needs about {per_rank / GiB:.0f} GiB per rank for weights, gradients and Adam state, "
        f"{need / GiB:.0f} GiB for the {local_ranks} rank(s) on this machine, which has {have / GiB:.0f} GiB; "
        f"run it on GPUs (see --print-plan for the per-rank plan)"
    )
