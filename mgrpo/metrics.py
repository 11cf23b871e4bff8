"""A step's metrics under the names verl users read (`reward/mean`, `actor/kl_old`, `timing/rollout`, ...): one
flat dict, the same keys in every sink. Loss metrics are token-weighted means reduced from the last pipeline
stage; reward statistics are never NaN; counters say when something was left out (failed rewards, samples
without rollout logprobs, skipped optimizer steps).

Definitions: `actor/kl_old` is the k2 estimate mean(0.5 (log pi/pi_old)^2) over loss tokens (0 while the policy
is the rollout policy); `actor/kl_ref` is the KL to the reference (the k-estimator of the loss term, or the mean
per-sequence k1 sum with kl_in_reward); `actor/clip_frac` the fraction of loss tokens whose ratio was clipped;
`response_length/clip_ratio` the fraction of samples that stopped at rollout.max_tokens; `perf/tokens_per_s`
response tokens per second of the step's wall clock; `timing/<phase>` seconds per phase, `timing/step` the step's
wall clock (checkpoint included) and `timing/other` what no phase timer saw (all seconds).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mgrpo.parallel.device import cpu_group
from mgrpo.parallel.state import holds_metrics

# loss-side names (actor.train_step stats) -> logged names
_ACTOR = {
    "clip_frac": "actor/clip_frac",
    "clip_frac_low": "actor/clip_frac_low",
    "clip_frac_high": "actor/clip_frac_high",
    "dual_clip_frac": "actor/dual_clip_frac",
    "approx_kl": "actor/kl_old",
    "kl": "actor/kl_ref",
    "entropy": "actor/entropy",
    "loss": "actor/loss",
    "sapo_grad_weight": "actor/sapo_grad_weight",
    "cispo_clip_frac_pos": "actor/cispo_clip_frac_pos",
    "entropy_mask_frac": "actor/entropy_mask_frac",
}


def reduce_last_stage(metrics: dict, mean_keys: list, sum_keys: list) -> dict:
    """Token-weighted means of `mean_keys` and sums of `sum_keys` over the ranks that hold them, on every rank."""
    report = holds_metrics()
    tokens = metrics.get("tokens", 0.0) if report else 0.0
    vec = torch.tensor(
        [metrics.get(k, 0.0) * tokens if report else 0.0 for k in mean_keys]
        + [metrics.get(k, 0.0) if report else 0.0 for k in sum_keys]
        + [tokens],
        dtype=torch.float64,
    )
    dist.all_reduce(vec, group=cpu_group())
    out = {k: float(v) / max(float(vec[-1]), 1.0) for k, v in zip(mean_keys, vec)}
    out.update({k: float(v) for k, v in zip(sum_keys, vec[len(mean_keys) :])})
    return out


def loss_metric_keys(alg) -> list:
    """The same list on every rank (only last-stage ranks hold the values): a collective needs equal sizes."""
    keys = ["clip_frac", "approx_kl", "entropy"]
    if alg.policy_loss == "sapo":
        keys.append("sapo_grad_weight")  # the gate's mean gradient weight (1 on-policy)
    elif alg.policy_loss == "cispo":
        keys.append("cispo_clip_frac_pos")  # capped tokens with A > 0 (ms-swift's count); clip_frac counts all
    else:
        keys += ["clip_frac_low", "clip_frac_high"] + (["dual_clip_frac"] if alg.clip_ratio_c is not None else [])
    if alg.top_entropy_quantile < 1:
        keys.append("entropy_mask_frac")  # share of loss tokens the top-entropy mask keeps
    if alg.kl_coef > 0 and not alg.kl_in_reward:
        keys.append("kl")  # the KL loss term against the reference
    keys += [f"rollout_is/{k}" for k in ("rollout_logp_abs_diff", "rollout_kl_k1", "rollout_kl_k3")]
    if alg.rollout_is_mode:
        kind = "clip" if alg.rollout_is_mode.endswith(("truncate", "tis")) else "mask"
        keys += [f"rollout_is/{k}" for k in ("rollout_is_weight_mean", f"rollout_is_{kind}_frac")]
    return keys


def _mean_std(values: list) -> tuple:
    t = torch.tensor(values, dtype=torch.float64)
    return (float(t.mean()) if values else 0.0), (float(t.std()) if len(values) > 1 else 0.0)


def reward_metrics(samples: list, funcs: list = ()) -> dict:
    """reward/mean and reward/std over the samples whose reward is finite (0.0, never NaN, when too few), one
    reward/<function> mean per function over the samples it scored, and reward/failed (a count)."""
    finite = [float(s.reward) for s in samples if s.reward is not None and math.isfinite(s.reward)]
    mean, std = _mean_std(finite)
    out = {"reward/mean": mean, "reward/std": std, "reward/failed": len(samples) - len(finite)}
    for name in funcs:
        vals = [s.info.get("rewards", {}).get(name) for s in samples]
        vals = [float(v) for v in vals if v is not None and math.isfinite(v)]
        if vals:
            out[f"reward/{name}"] = _mean_std(vals)[0]
    return out


def length_metrics(samples: list) -> dict:
    resp = [len(s.response_ids) for s in samples] or [0]
    return {
        "response_length/mean": sum(resp) / len(resp),
        "response_length/max": max(resp),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
        "prompt_length/mean": sum(len(s.prompt_ids) for s in samples) / max(len(samples), 1),
    }


def update_metrics(cfg, out: dict) -> dict:
    """One optimizer step's logged actor metrics (a collective: every rank calls it)."""
    reduced = reduce_last_stage(out, loss_metric_keys(cfg.algorithm) + ["ratio_mean"], ["loss"])
    metrics = {_ACTOR.get(k, "actor/" + k if k == "ratio_mean" else k): v for k, v in reduced.items()}
    metrics.update(
        {
            "actor/grad_norm": out["grad_norm"],
            "actor/lr": out.get("lr", 0.0),
            "actor/skipped_steps": out["skipped_steps"],
        }
    )
    metrics.update({k: v for k, v in out.items() if k.startswith("moe/")})  # reduced over all ranks already
    return metrics


def step_clock(metrics: dict, timer, samples: list) -> dict:
    """`timing/<phase>` per phase, `timing/step` the step's wall clock (from the timer's start to now, so work
    between phases counts), `timing/other` the part no phase saw, and `perf/tokens_per_s` response tokens per
    second of that wall clock. Benchmarks compare these wall clocks with a peer's."""
    wall = timer.elapsed()
    metrics.update({f"timing/{k}": v for k, v in timer.totals.items()})
    metrics.update({"timing/step": wall, "timing/other": max(wall - sum(timer.totals.values()), 0.0)})
    metrics["perf/tokens_per_s"] = sum(len(s.response_ids) for s in samples) / max(wall, 1e-9)
    if "timing/wait_train" in metrics:  # ahead modes: the share of the step the engine waited for the trainer
        metrics["rollout/engine_idle_frac"] = min(metrics["timing/wait_train"] / max(wall, 1e-9), 1.0)
    return metrics


def step_metrics(cfg, samples: list, updates: list, extra: dict, version: int) -> tuple:
    """(everything logged for one rollout step, the per-optimizer-step actor metrics). Actor metrics are means
    over the step's optimizer steps (mini-batches x iterations); `actor/lr` and `actor/skipped_steps` are the
    last one's. A collective: every rank calls it."""
    per_update = [update_metrics(cfg, out) for out in updates]
    metrics = {k: sum(u[k] for u in per_update) / len(per_update) for k in per_update[0]}
    metrics.update({k: per_update[-1][k] for k in ("actor/lr", "actor/skipped_steps")})
    metrics.update(reward_metrics(samples, cfg.reward.funcs), **length_metrics(samples), **extra)
    if cfg.algorithm.overlong_filter:  # samples given loss mask 0 for stopping at rollout.max_tokens
        metrics["response_length/overlong_filtered"] = sum(s.finish_reason == "length" for s in samples)
    if cfg.algorithm.rollout_is_mode:
        from mgrpo.data.batching import missing_rollout_logprobs

        metrics["rollout_is/missing_logprob_samples"] = missing_rollout_logprobs(samples)
    if cfg.rollout.scheduler:
        from mgrpo.rollout.multiturn.driver import trajectory_metrics

        metrics.update(trajectory_metrics(samples))
    for s in samples:  # requests per engine: how the step was spread
        key = f"rollout/requests/{s.info.get('engine', 'engine')}"
        metrics[key] = metrics.get(key, 0) + 1
    metrics["weight_version"] = version
    return metrics, per_update
