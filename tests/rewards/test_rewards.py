"""Reward semantics: None = not applicable (nansum; all None gives 0), NaN or a raise = the sample failed (NaN
reward, a warning, left out of advantages and loss), the wrong number of values = an error naming the function."""

import logging
import math

import pytest
import torch

from mgrpo.rewards.registry import RewardError, register_reward, score
from mgrpo.rollout.types import Sample


def _samples(n=4):
    return [Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], info={"i": i}) for i in range(n)]


@register_reward("_t_const")
def _const(samples, tokenizer, **_):
    return [1.0 for _ in samples]


@register_reward("_t_none_for_odd")
def _none_for_odd(samples, tokenizer, **_):
    return [None if s.info["i"] % 2 else 0.5 for s in samples]


@register_reward("_t_all_none")
def _all_none(samples, tokenizer, **_):
    return [None for _ in samples]


@register_reward("_t_nan_for_2")
def _nan_for_2(samples, tokenizer, **_):
    return [float("nan") if s.info["i"] == 2 else 0.0 for s in samples]


@register_reward("_t_raises_for_1")
def _raises_for_1(samples, tokenizer, **_):
    if any(s.info["i"] == 1 for s in samples):
        raise ZeroDivisionError("bad sample")
    return [0.25 for _ in samples]


@register_reward("_t_short")
def _short(samples, tokenizer, **_):
    return [0.0] * (len(samples) - 1)


@register_reward("_t_string")
def _string(samples, tokenizer, **_):
    return ["1.0" for _ in samples]


def test_none_is_skipped_in_the_weighted_sum():
    s = _samples()
    total = score(s, None, ["_t_const", "_t_none_for_odd"], weights=[2.0, 4.0])
    assert total == [2.0 + 4 * 0.5, 2.0, 2.0 + 4 * 0.5, 2.0], "None counts as nothing, not as NaN"
    assert s[1].info["rewards"] == {"_t_const": 1.0, "_t_none_for_odd": None}
    s = _samples(2)
    assert score(s, None, ["_t_all_none"]) == [0.0, 0.0], "every function says None: 0, as ms-swift"


def test_nan_and_raise_fail_only_their_samples(caplog):
    s = _samples()
    with caplog.at_level(logging.WARNING, logger="mgrpo.rewards"):
        total = score(s, None, ["_t_const", "_t_nan_for_2", "_t_raises_for_1"])
    assert total[0] == 1.25 and total[3] == 1.25
    assert math.isnan(total[1]) and math.isnan(total[2])
    assert s[1].info["reward_failed"] == ["_t_raises_for_1"] and s[2].info["reward_failed"] == ["_t_nan_for_2"]
    assert "reward_failed" not in s[0].info
    text = caplog.text
    assert "_t_raises_for_1" in text and "ZeroDivisionError" in text and "2 of 4 samples failed" in text


def test_wrong_count_or_type_is_an_error_naming_the_function():
    with pytest.raises(RewardError, match="reward function '_t_short' returned 3 values for 4 samples"):
        score(_samples(), None, ["_t_short"])
    with pytest.raises(RewardError, match="reward function '_t_string' returned '1.0'"):
        score(_samples(), None, ["_t_string"])


def test_failed_samples_get_no_advantage_no_loss_and_leave_the_counts(single_rank):
    """Through the trainer's batching: a failed sample's loss mask is 0 and it is not counted in the number of
    sequences of seq-mean aggregations; the advantage estimators give it 0 and leave it out of group stats."""
    from mgrpo.config import load_config
    from mgrpo.data.batching import build_generation_batch
    from mgrpo.loss.advantages import compute_advantages
    from mgrpo.metrics import reward_metrics

    s = _samples()
    for x in s:
        x.group_id = 0
    score(s, None, ["_t_const", "_t_nan_for_2"])
    cfg = load_config(
        argv=["--model.path", "m", "--algorithm.aggregation", "seq-mean-token-sum", "--train.micro_batch_size", "4"],
        check_files=False,
    )
    batch = build_generation_batch(s, cfg, pad_id=0)
    mb = batch.minibatches[0].microbatches[0]
    assert mb["loss_mask"][2].sum() == 0 and mb["token_weight"][2].sum() == 0
    assert float(mb["token_weight"][0].max()) == pytest.approx(1 / 3), "3 sequences count, not 4"
    adv = compute_advantages("grpo", batch.rewards, batch.group_ids, cfg.algorithm)
    assert adv[2] == 0 and torch.isfinite(adv).all()
    stats = reward_metrics(s, ["_t_const", "_t_nan_for_2"])
    assert stats == {
        "reward/mean": 1.0,
        "reward/std": 0.0,
        "reward/failed": 1,
        "reward/_t_const": 1.0,
        "reward/_t_nan_for_2": 0.0,
    }


def test_reward_std_is_never_nan():
    from mgrpo.metrics import reward_metrics

    one = _samples(1)
    one[0].reward = 0.5
    assert reward_metrics(one) == {"reward/mean": 0.5, "reward/std": 0.0, "reward/failed": 0}
    bad = _samples(2)
    for x in bad:
        x.reward = float("nan")
    assert reward_metrics(bad) == {"reward/mean": 0.0, "reward/std": 0.0, "reward/failed": 2}
