"""A step's metrics: reward statistics (never NaN), the policy loss's token-weighted means reduced from the
last pipeline stage, and the counters that say when something was left out (failed rewards, samples without
rollout logprobs, skipped optimizer steps)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


def holds_metrics() -> bool:
    """Last-stage TP0 ranks hold the loss metrics (every CP rank its own tokens' share)."""
    return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0


def reduce_last_stage(metrics: dict, mean_keys: list, sum_keys: list) -> dict:
    """Token-weighted means of `mean_keys` and sums of `sum_keys` over the ranks that hold them, on every rank."""
    report = holds_metrics()
    tokens = metrics.get("tokens", 0.0) if report else 0.0
    vec = torch.tensor([metrics.get(k, 0.0) * tokens if report else 0.0 for k in mean_keys]
                       + [metrics.get(k, 0.0) if report else 0.0 for k in sum_keys] + [tokens], dtype=torch.float64)
    dist.all_reduce(vec)
    out = {k: float(v) / max(float(vec[-1]), 1.0) for k, v in zip(mean_keys, vec)}
    out.update({k: float(v) for k, v in zip(sum_keys, vec[len(mean_keys):])})
    return out


def loss_metric_keys(alg) -> list:
    """The same list on every rank (only last-stage ranks hold the values): a collective needs equal sizes."""
    keys = ["clip_frac", "approx_kl"]
    if alg.policy_loss != "cispo":
        keys += ["clip_frac_low", "clip_frac_high"] + (["dual_clip_frac"] if alg.clip_ratio_c is not None else [])
    if alg.kl_coef > 0 and not alg.kl_in_reward:
        keys.append("kl")  # the KL loss term against the reference, reported as kl_ref
    if alg.entropy_coef > 0:
        keys.append("entropy")
    if alg.rollout_is_mode:
        kind = "clip" if alg.rollout_is_mode.endswith(("truncate", "tis")) else "mask"
        keys += [f"rollout_is/{k}" for k in ("rollout_logp_abs_diff", "rollout_kl_k1", "rollout_kl_k3",
                                             "rollout_is_weight_mean", f"rollout_is_{kind}_frac")]
    return keys


def reward_stats(samples: list) -> dict:
    """Mean and std over the samples whose reward is finite (0.0, not NaN, when there are too few)."""
    finite = [float(s.reward) for s in samples if s.reward is not None and math.isfinite(s.reward)]
    r = torch.tensor(finite, dtype=torch.float64)
    return {"reward_mean": float(r.mean()) if len(finite) else 0.0,
            "reward_std": float(r.std()) if len(finite) > 1 else 0.0,
            "reward_failed": len(samples) - len(finite)}


def step_metrics(cfg, samples: list, train: dict, extra: dict, timings: dict, version: int) -> dict:
    """Everything logged for one step (a collective: every rank calls it)."""
    metrics = reduce_last_stage(train, loss_metric_keys(cfg.algorithm), ["loss"])
    if "kl" in metrics:
        metrics["kl_ref"] = metrics.pop("kl")
    n_tokens = sum(len(s.response_ids) for s in samples)
    metrics.update(reward_stats(samples), **extra, response_len=n_tokens / max(len(samples), 1),
                   grad_norm=train["grad_norm"], skipped_steps=train["skipped_steps"],
                   tokens_per_s=n_tokens / max(sum(timings.values()), 1e-9), weight_version=version,
                   **{f"time_{k}": v for k, v in timings.items()})
    if cfg.algorithm.rollout_is_mode:
        metrics["rollout_is/missing_logprob_samples"] = sum(1 for s in samples if s.rollout_logprobs is None)
    return metrics
