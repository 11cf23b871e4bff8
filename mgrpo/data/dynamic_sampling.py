"""DAPO dynamic sampling: groups whose rewards all agree carry no GRPO signal; drop them and draw new prompts.

`collect()` draws generation rounds (each a full `rollout.prompts_per_step` batch of fresh prompts) until enough
groups with a non-zero reward spread are kept, or `algorithm.max_resample_times` extra rounds are spent. A full
batch is trimmed to `prompts_per_step` groups (like verl's DAPO trainer, `recipe/dapo/dapo_ray_trainer.py`, which
keeps only groups with signal from every round). Only samples that will train count towards a group's signal:
with `algorithm.overlong_filter` a truncated sample is neither right nor wrong, so it leaves the group.

When the retry budget runs out short of a full batch, every kept group trains and nothing else does: the batch is
filled up to the next size every rank can split evenly (a multiple of `unit_groups`) with dropped groups marked
as padding (`sample.info[PADDING]`): they train nothing and count nowhere (loss mask 0, out of the aggregation
counts and the advantages' statistics), so they only keep the shapes even. verl raises at this point
(`max_num_gen_batches`); we train on what has signal, log a warning every time, and count it in
`dynamic_sampling/limit_hit` and `dynamic_sampling/padding_groups`. Every rank sees every sample, so every rank
takes the same decisions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

PADDING = "dynamic_sampling_padding"  # sample.info key: the sample only fills the batch's shape, it trains nothing
log = logging.getLogger("mgrpo.dynamic_sampling")


@dataclass
class SamplingCounts:
    """Logged as dynamic_sampling/<field>."""

    kept_groups: int = 0  # groups with signal in the trained batch
    dropped_groups: int = 0  # zero-signal groups seen over all rounds
    resample_rounds: int = 0  # extra generation rounds
    resampled_groups: int = 0  # prompts drawn by those rounds
    padding_groups: int = 0  # zero-signal groups that only fill the batch to an evenly divisible size (train nothing)
    trimmed_groups: int = 0  # groups with signal left out because the batch was full
    limit_hit: int = 0  # 1 when max_resample_times ran out before the batch was full

    def metrics(self) -> dict:
        return {f"dynamic_sampling/{k}": float(v) for k, v in self.__dict__.items()}


def by_group(samples: list) -> list:
    """Samples as a list of groups (lists), in order of first appearance."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())


def has_signal(group: list, overlong_filter: bool = False) -> bool:
    """True when the finite rewards of the group's samples that will train differ (std > 0); failed (NaN)
    rewards and, with the overlong filter, truncated samples do not count."""
    rewards = [
        s.reward
        for s in group
        if s.reward is not None and math.isfinite(s.reward) and not (overlong_filter and s.finish_reason == "length")
    ]
    return len(rewards) > 1 and max(rewards) - min(rewards) > 0


def unit_groups(cfg, dp: int) -> int:
    """The smallest number of groups whose samples split evenly over steps_per_generation mini-batches and the DP
    ranks (and, with pipeline parallelism, into equal micro-batches)."""
    t, n = cfg.train, cfg.rollout.n
    per_rank = cfg.rollout.prompts_per_step * n // (t.steps_per_generation * dp)
    quantum = t.steps_per_generation * dp * (min(t.micro_batch_size, per_rank) if cfg.parallel.pp > 1 else 1)
    return quantum // math.gcd(quantum, n)


def collect(
    draw, target: int, unit: int, max_resample_times: int, warn: bool = True, overlong_filter: bool = False
) -> tuple:
    """(samples of the trained batch, SamplingCounts). `draw(round)` returns one round's scored samples."""
    counts, kept, dropped = SamplingCounts(), [], []
    for round_ in range(max_resample_times + 1):
        groups = by_group(draw(round_))
        if round_:
            counts.resample_rounds += 1
            counts.resampled_groups += len(groups)
        for g in groups:
            (kept if has_signal(g, overlong_filter) else dropped).append(g)
        if len(kept) >= target:
            break
    counts.dropped_groups = len(dropped)
    if len(kept) >= target:
        counts.trimmed_groups = len(kept) - target
        chosen = kept[:target]
    else:
        counts.limit_hit = 1
        size = min(max(unit, -(-len(kept) // unit) * unit), len(kept) + len(dropped))
        padding = dropped[: size - len(kept)]
        for s in (s for g in padding for s in g):
            s.info[PADDING] = True
        chosen, counts.padding_groups = kept + padding, len(padding)
        if warn:
            log.warning(
                "dynamic sampling: %d of %d groups with reward signal after algorithm.max_resample_times=%d "
                "extra rounds; training on those %d only (%d zero-signal groups fill the batch to an evenly "
                "divisible size and train nothing)%s. Raise max_resample_times, or make the task harder or "
                "easier if most groups agree",
                len(kept),
                target,
                max_resample_times,
                len(kept),
                len(padding),
                "; this step trains nothing" if not kept else "",
            )
    counts.kept_groups = min(len(kept), target)
    return [s for g in chosen for s in g], counts
