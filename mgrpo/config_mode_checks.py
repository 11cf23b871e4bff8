"""Checks of the run modes that span sections: async and partial rollout, LoRA, sequence packing, colocated
engines and the model's fast paths (fusions, recompute). `config_checks.validate_config` runs them; each message
names the field and the fix."""

from __future__ import annotations


def async_problems(cfg) -> list:
    """rollout.mode / max_staleness: the values and the combinations the producer cannot run."""
    r, e = cfg.rollout, []
    if r.mode not in ("sync", "one_step_off", "async"):
        return [f"rollout.mode={r.mode!r}: use sync, one_step_off or async"]
    if r.mode == "sync" and r.max_staleness not in (None, 0):
        e.append(f"rollout.max_staleness={r.max_staleness} with rollout.mode=sync: set rollout.mode to async")
    if r.mode == "one_step_off" and r.max_staleness not in (None, 1):
        e.append(
            f"rollout.max_staleness={r.max_staleness} with rollout.mode=one_step_off (always 1): use "
            f"rollout.mode=async for another bound"
        )
    if r.max_staleness is not None and r.max_staleness < 0:
        e.append(f"rollout.max_staleness={r.max_staleness} must be >= 0")
    if r.mode != "sync" and cfg.algorithm.dynamic_sampling:
        e.append(
            f"rollout.mode={r.mode} with algorithm.dynamic_sampling: DAPO's resampling rounds depend on the "
            f"step's own rewards; use rollout.mode=sync"
        )
    return e + partial_problems(cfg)


def partial_problems(cfg) -> list:
    """rollout.partial: in-flight weight updates need generation running during a push, and an engine that can
    hold its requests through one (vLLM's pause_generation(mode="keep"), colocated or behind mgrpo's server)."""
    r = cfg.rollout
    if r.recompute_kv_after_update and not r.partial:
        return ["rollout.recompute_kv_after_update=true needs rollout.partial=true (it recomputes held requests)"]
    if not r.partial:
        return []
    e = []
    if r.mode == "sync":
        e.append(
            "rollout.partial=true with rollout.mode=sync: nothing generates during a push; use one_step_off or async"
        )
    if r.engine == "sglang" and not r.recompute_kv_after_update:
        e.append(
            "rollout.partial=true with rollout.engine=sglang: SGLang's pause that holds requests through a push is "
            "mode retract, which prefills their prefixes again under the new weights; set "
            "rollout.recompute_kv_after_update=true (mode in_place, which keeps the old KV, is not built)"
        )
    elif r.engine not in ("vllm", "remote", "sglang"):
        e.append(
            f"rollout.partial=true with rollout.engine={r.engine}: in-flight updates are built for vLLM engines "
            f"(pause_generation mode keep), colocated or remote, and SGLang; use one of those, or "
            f"rollout.partial=false"
        )
    if r.lora_sync == "adapter" and cfg.model.lora.rank:
        e.append("rollout.partial=true with rollout.lora_sync=adapter: not supported; use lora_sync=merged")
    return e


def lora_problems(cfg) -> list:
    """model.lora and rollout.lora_sync: values only (lora_layout_problems checks them against the model)."""
    from mgrpo.models.lora import ALL_LINEAR, lora_targets

    lo, e = cfg.model.lora, []
    if cfg.rollout.lora_sync not in ("merged", "adapter"):
        e.append(f"rollout.lora_sync={cfg.rollout.lora_sync!r}: use merged or adapter")
    if not isinstance(lo.rank, int) or lo.rank < 0:
        return e + [f"model.lora.rank={lo.rank!r} must be an integer >= 0 (0 = full-parameter training)"]
    if lo.rank == 0:
        return e
    if not lo.alpha > 0:
        e.append(f"model.lora.alpha={lo.alpha!r} must be > 0; scaling is alpha / rank, e.g. 2 x rank")
    if not 0 <= lo.dropout < 1:
        e.append(f"model.lora.dropout={lo.dropout!r} must be in [0, 1)")
    try:
        lora_targets(lo)
    except ValueError as err:
        e.append(f"model.lora.target_modules: {err}; use all-linear or some of {', '.join(ALL_LINEAR)}")
    if cfg.rollout.lora_sync == "adapter" and (
        cfg.rollout.engine not in ("vllm", "remote")
        or (cfg.rollout.engine == "remote" and cfg.rollout.remote.transport == "collective")
    ):
        e.append(
            f"rollout.lora_sync=adapter with rollout.engine={cfg.rollout.engine}: only vLLM engines (colocated, "
            f"or remote servers over rollout.remote.transport http) load adapters; use rollout.lora_sync=merged"
        )
    return e


def packing_problems(cfg) -> list:
    """train.max_tokens_per_microbatch and train.sequence_packing against the layout."""
    t, p = cfg.train, cfg.parallel
    if t.max_tokens_per_microbatch < 0:
        return [
            f"train.max_tokens_per_microbatch={t.max_tokens_per_microbatch}: use a positive token budget, or 0 "
            f"for micro-batches of train.micro_batch_size samples"
        ]
    if t.max_tokens_per_microbatch and p.pp > 1 and not t.sequence_packing:
        return [
            "train.max_tokens_per_microbatch with parallel.pp > 1 needs train.sequence_packing true: pipeline "
            "stages exchange one activation shape, so micro-batches must be single packed rows"
        ]
    if t.max_tokens_per_microbatch and p.vpp:
        return [
            "train.max_tokens_per_microbatch with parallel.vpp: the interleaved schedule needs a fixed number of "
            "micro-batches; use train.micro_batch_size"
        ]
    return []


def colocate_problems(cfg) -> list:
    """rollout.vllm.sleep_level / train.offload: the engine and the trainer take turns with one device."""
    r, level, offload, e = cfg.rollout, cfg.rollout.vllm.sleep_level, cfg.train.offload, []
    if level not in (0, 1, 2):
        e.append(
            f"rollout.vllm.sleep_level={level}; use 0 (awake), 1 (weights to host, KV dropped) or 2 (both dropped)"
        )
    from mgrpo.actor_offload import LEVELS

    if offload not in LEVELS:
        e.append(f"train.offload={offload!r}; use {', '.join(LEVELS[:-1])} or {LEVELS[-1]}")
    if e or (not level and offload == "none"):  # a bad value is the one line; what follows would repeat it
        return e
    if r.engine != "vllm":
        e.append(
            f"rollout.vllm.sleep_level / train.offload make room for a colocated engine, and rollout.engine="
            f"{r.engine!r} has none: use rollout.engine vllm, or leave them at 0 / none"
        )
    if r.mode != "sync":
        e.append(
            f"rollout.vllm.sleep_level / train.offload with rollout.mode={r.mode}: the engine generates while the "
            f"trainer trains, so neither can give its memory to the other; use rollout.mode sync"
        )
    if offload != "none" and cfg.checkpoint.async_save:
        e.append("train.offload with checkpoint.async_save: the save may still read what the offload frees; drop one")
    if level == 2 and cfg.model.lora.rank > 0 and r.lora_sync == "adapter":
        e.append(
            "rollout.vllm.sleep_level=2 drops the engine's base weights and adapter-only sync never sends them "
            "again (vllm#29341: garbage after the wake); use sleep_level 1 or rollout.lora_sync merged"
        )
    return e


def fast_path_problems(cfg) -> list:
    """model.fusions, train.recompute, train.overlap_*: one line per bad value."""
    from mgrpo.models.fast_paths import FUSIONS, RECOMPUTE

    t, e = cfg.train, []
    if cfg.model.fusions not in FUSIONS:
        e.append(f"model.fusions={cfg.model.fusions!r}; use auto (fused kernels on a GPU) or off")
    if t.step_timeout_s is not None and not t.step_timeout_s >= 0:
        e.append(f"train.step_timeout_s={t.step_timeout_s}; use seconds > 0, 0 for no step watchdog, or null (auto)")
    if t.recompute not in RECOMPUTE:
        e.append(f"train.recompute={t.recompute!r}; use none, selective (core attention) or full (whole layers)")
    if t.overlap_param_gather and not t.use_distributed_optimizer:
        e.append(
            "train.overlap_param_gather=true needs train.use_distributed_optimizer true (only its parameters are "
            "gathered); set both, or leave overlap_param_gather null"
        )
    return e
