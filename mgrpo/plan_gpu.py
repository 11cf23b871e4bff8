"""`--print-plan`'s memory per GPU of a colocated run: the trainer rank and the engine worker that share each GPU,
at the peak of each phase of the step (mgrpo/rollout/colocate.py), with the run's `rollout.vllm.sleep_level` and
`train.offload` and without them.

    train    trainer: weights, grads, optimizer, activations, logits (plan.memory_estimate), a KL reference's
             weights; engine: asleep (level 1/2: its CUDA context and what vLLM keeps outside its memory pools),
             or its whole budget (level 0)
    push     trainer: weights, grads, optimizer (activations freed) and the transport's ring of two buckets;
             engine: weights awake, KV cache asleep, one bucket being copied in
    rollout  trainer: what train.offload leaves on the device; engine: its whole budget. vLLM checks this one
             when it starts (`request_memory`, vllm/v1/worker/utils.py: free memory >= gpu_memory_utilization x
             the device), so the trainer offloads before the engine starts (trainer.py)

The engine's budget is gpu_memory_utilization x the device; vLLM fills what its weights, profiled activations
and CUDA graphs leave with KV cache (`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py), so the
plan reports that KV cache in tokens and in sequences of max_model_len. Its profile runs max_num_batched_tokens
tokens (2048, vLLM's default for an AsyncLLM: `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`)
and max_num_seqs rows of fp32 logits.

Not measured (no GPU here): the constants below, from vLLM's and NCCL's documentation and verl's notes; the
trainer's terms are plan.memory_estimate's, calibrated on CPU.
"""

from __future__ import annotations

GiB = 1 << 30
GPU_GIB = {"h100": 81559 / 1024, "h200": 143771 / 1024}  # nvidia-smi's total of an H100 80GB / H200 141GB
CUDA_CONTEXT = 0.5 * GiB  # per process on the GPU (CUDA 12, lazy module loading)
NCCL_BUFFERS = 0.5 * GiB  # a trainer rank's communicators (TP, DP, PP, ...), a TP engine worker's one
ENGINE_ASLEEP = 0.25 * GiB  # vLLM allocations outside its sleep pools (sampler, metadata) after sleep(1 or 2)
CUDA_GRAPHS = 0.5 * GiB  # captured graphs' pool when not enforce_eager
ENGINE_BATCHED_TOKENS = 2048


def engine_memory(cfg, info, params: int, adapter: int, gpu: float) -> dict:
    """Bytes per engine worker: weights (`params` HF parameters over the engine's TP, plus an adapter-only
    sync's `adapter`), profiled activations, graphs, and the KV cache the rest of the budget buys."""
    v, r = cfg.rollout.vllm, cfg.rollout
    tp = v.tensor_parallel_size
    elem = 4 if v.dtype == "float32" else 2  # "auto" is bfloat16 on a GPU
    weights = (params + adapter) * elem / tp
    if info.moe is not None:
        mlp = info.moe.topk * 3 * info.moe.ffn_hidden_size
    else:
        mlp = 3 * info.intermediate_size
    activations = ENGINE_BATCHED_TOKENS * (4 * info.hidden_size + mlp / tp) * elem
    activations += r.max_num_seqs * info.vocab_size * 4 * 2  # the sampler's fp32 logits and probabilities
    graphs = 0 if v.enforce_eager else CUDA_GRAPHS
    budget = v.gpu_memory_utilization * gpu
    kv = budget - weights - activations - graphs
    kv_per_token = 2 * info.num_hidden_layers * max(info.num_key_value_heads // tp, 1) * info.head_dim * elem
    max_len = v.max_model_len or info.max_position_embeddings
    tokens = max(int(kv // kv_per_token), 0)
    return dict(
        weights=weights,
        activations=activations,
        graphs=graphs,
        budget=budget,
        kv=kv,
        kv_per_token=kv_per_token,
        tokens=tokens,
        sequences=tokens // max_len,
        max_len=max_len,
        context=CUDA_CONTEXT + (NCCL_BUFFERS if tp > 1 else 0),
    )


def trainer_phases(cfg, m: dict, ref: float, world: int) -> dict:
    """A trainer rank's bytes in each phase (`m`: its plan.memory_estimate) as configured, and without offload."""
    state = m["weights"] + m["grads"] + m["optimizer_in_use"] + m["overhead"] + ref
    left = {
        "none": state,
        "optimizer": state - m["optimizer_in_use"],
        "optimizer+grads": state - m["optimizer_in_use"] - m["grads"],
        "all": m["overhead"] + ref,
    }
    ring = 2 * (cfg.rollout.update_bucket_mb << 20)
    context = CUDA_CONTEXT + (NCCL_BUFFERS if world > 1 else 0)
    return dict(
        train=m["total"] + ref + context,
        push=state + ring + context,
        rollout=left[cfg.train.offload] + context,
        rollout_no_offload=state + context,
    )


def engine_map(cfg, plan: dict) -> tuple:
    """(GPUs per engine, host per engine) as `start_engine` will place them (rollout/placement.py), from the plan's
    DP groups; raises PlacementError."""
    from mgrpo.rollout.placement import planned_devices

    dp_of = [0] * plan["world"]
    for group in plan["groups"]["dp"]:
        for i, r in enumerate(group):
            dp_of[r] = i
    return planned_devices(cfg, dp_of)


def gpu_rows(cfg, plan: dict, gpu: float) -> tuple:
    """(engine memory, one row per GPU of the first node): its rank, engine, and the peak of each phase, as
    configured and without sleep/offload."""
    devices, _ = engine_map(cfg, plan)
    holder = {(0, int(d)): e for e, ds in enumerate(devices) for d in ds if ds}  # engines on node 0 only
    adapter = (plan["trainable"] or 0) if cfg.rollout.lora_sync == "adapter" and cfg.model.lora.rank else 0
    base = plan["unique_total"] - (plan["trainable"] or 0)  # the engine holds the base (merged: adapters folded in)
    engine = engine_memory(cfg, plan["info"], base, adapter, gpu)
    level = cfg.rollout.vllm.sleep_level
    rows = []
    for x in plan["ranks"][: min(8, plan["world"])]:
        m = dict(x["memory"])
        m["optimizer_in_use"] = m["optimizer_distributed"] if cfg.train.use_distributed_optimizer else m["optimizer"]
        ref = m["weights"] if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.rank else 0.0  # a frozen copy
        t = trainer_phases(cfg, m, ref, plan["world"])
        e = holder.get((0, x["rank"]))
        awake = asleep = pushing = 0.0  # a GPU no engine uses
        if e is not None:
            awake = engine["budget"] + engine["context"]
            # asleep: what vLLM keeps outside its pools; pushing: weights awake, KV asleep, one bucket coming in
            asleep = ENGINE_ASLEEP + engine["context"] if level else awake
            pushing = engine["weights"] + engine["graphs"] + engine["context"] + (cfg.rollout.update_bucket_mb << 20)
        rows.append(
            dict(
                gpu=x["rank"],
                rank=x["rank"],
                engine=e,
                train=t["train"] + asleep,
                push=t["push"] + (pushing if level else awake),
                rollout=t["rollout"] + awake,
                plain_train=t["train"] + awake,
                plain_rollout=t["rollout_no_offload"] + awake,
            )
        )
    return engine, rows


def format_gpu_plan(cfg, plan: dict, gpu_gib: float) -> list:
    """The per-GPU lines of `--print-plan` for a colocated vLLM engine."""
    gpu = gpu_gib * GiB
    engine, rows = gpu_rows(cfg, plan, gpu)
    v, g = cfg.rollout.vllm, lambda x: f"{x / GiB:7.1f}"  # noqa: E731
    lines = [
        f"engine worker (vLLM, TP {v.tensor_parallel_size}, gpu_memory_utilization {v.gpu_memory_utilization} of "
        f"{gpu_gib:.1f} GiB = {engine['budget'] / GiB:.1f} GiB): weights {engine['weights'] / GiB:.1f}, "
        f"profiled activations {engine['activations'] / GiB:.1f}, CUDA graphs {engine['graphs'] / GiB:.1f}, "
        f"KV cache {engine['kv'] / GiB:.1f} GiB = {engine['tokens']:,} tokens = {engine['sequences']} sequences "
        f"of max_model_len {engine['max_len']}",
        f"memory per GPU, GiB (node 0; estimate; the peak of each phase; sleep_level {v.sleep_level}, "
        f"train.offload {cfg.train.offload}; CUDA contexts and NCCL buffers included):",
        f"  {'gpu':>3} {'rank':>4} {'engine':>7} {'train':>7} {'push':>7} {'rollout':>7}   "
        f"without sleep/offload: {'train':>7} {'rollout':>7}",
    ]
    for r in rows:
        name = f"vllm#{r['engine']}" if r["engine"] is not None else "-"
        lines.append(
            f"  {r['gpu']:>3} {r['rank']:>4} {name:>7} {g(r['train'])} {g(r['push'])} {g(r['rollout'])}   "
            f"{'':23}{g(r['plain_train'])} {g(r['plain_rollout'])}"
        )
    peak, phase = max(((r[k], k) for r in rows for k in ("train", "push", "rollout")), key=lambda x: x[0])
    plain = max(max(r["plain_train"], r["plain_rollout"]) for r in rows)
    problems = []
    if engine["kv"] <= 0:
        problems.append(
            f"the engine's weights and activations ({(engine['weights'] + engine['activations']) / GiB:.1f} GiB) "
            f"fill its budget: raise rollout.vllm.gpu_memory_utilization or rollout.vllm.tensor_parallel_size"
        )
    elif engine["sequences"] < 1:
        problems.append(
            f"the KV cache holds {engine['tokens']:,} tokens, less than one sequence of max_model_len "
            f"{engine['max_len']}: vLLM refuses to start; raise gpu_memory_utilization or lower max_model_len"
        )
    if peak > gpu:
        problems.append(
            f"the {phase} phase needs {peak / GiB:.1f} GiB of a {gpu_gib:.1f} GiB GPU: set rollout.vllm.sleep_level "
            f"1, train.offload, a larger parallel.tp, or a smaller gpu_memory_utilization"
        )
    verdict = "fits" if not problems else "DOES NOT FIT: " + "; ".join(problems)
    lines.append(
        f"per GPU: largest {peak / GiB:.1f} GiB ({phase} phase) of {gpu_gib:.1f} GiB: {verdict}"
        f" (without sleep/offload: {plain / GiB:.1f} GiB)"
    )
    return lines
