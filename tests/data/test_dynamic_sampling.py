"""DAPO dynamic sampling: zero-std groups are dropped and replaced by new prompts until the batch is full, or the
limit is hit (logged) and the batch is topped up to an evenly divisible size; counts reach the metrics. The last
test runs the real trainer (HF engine) with a reward that is constant for chosen prompts."""
import logging
import os

import pytest

from mgrpo.config import load_config
from mgrpo.data.dynamic_sampling import collect, has_signal, unit_groups
from mgrpo.rewards.registry import register_reward, token_fraction
from mgrpo.rollout.types import Sample

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scripted_draw(rewards_per_round, n=2):
    """draw(round) -> samples; group g of round r gets the rewards given (one list per group)."""
    def draw(round_):
        out = []
        for g, rewards in enumerate(rewards_per_round[round_]):
            out += [Sample([1], [2], [1], reward=r, group_id=100 * round_ + g) for r in rewards]
        return out
    return draw


def test_zero_std_groups_are_replaced_until_the_batch_is_full():
    rounds = [[[1, 1], [0, 1], [0, 0], [1, 0]],  # 2 with signal
              [[0.5, 0.5], [0, 1], [1, 1], [0.2, 0.3]]]  # 2 more
    samples, counts = collect(scripted_draw(rounds), target=4, unit=1, max_resample_times=3)
    assert sorted({s.group_id for s in samples}) == [1, 3, 101, 103]
    assert all(has_signal([s for s in samples if s.group_id == g]) for g in (1, 3, 101, 103))
    assert counts.metrics() == {"dynamic_sampling/kept_groups": 4.0, "dynamic_sampling/dropped_groups": 4.0,
                                "dynamic_sampling/resample_rounds": 1.0, "dynamic_sampling/resampled_groups": 4.0,
                                "dynamic_sampling/topped_up_groups": 0.0, "dynamic_sampling/trimmed_groups": 0.0,
                                "dynamic_sampling/limit_hit": 0.0}


def test_a_full_batch_is_trimmed_and_nan_rewards_do_not_count_as_signal():
    nan = float("nan")
    rounds = [[[1, nan], [0, 1], [0, 0], [1, 0]], [[0, 1], [0, 1], [0, 1], [0, 1]]]
    samples, counts = collect(scripted_draw(rounds), target=4, unit=2, max_resample_times=1)
    assert sorted({s.group_id for s in samples}) == [1, 3, 100, 101]
    assert counts.trimmed_groups == 2 and counts.dropped_groups == 2 and counts.limit_hit == 0


def test_the_limit_is_logged_and_the_batch_topped_up_to_a_divisible_size(caplog):
    rounds = [[[1, 1], [0, 1], [0, 0], [1, 1]], [[1, 1], [1, 1], [0, 0], [0, 0]]]
    with caplog.at_level(logging.WARNING, logger="mgrpo.dynamic_sampling"):
        samples, counts = collect(scripted_draw(rounds), target=4, unit=2, max_resample_times=1)
    assert len({s.group_id for s in samples}) == 2 and 1 in {s.group_id for s in samples}
    assert counts.limit_hit == 1 and counts.topped_up_groups == 1 and counts.kept_groups == 1
    assert "1 of 4 groups with reward signal after algorithm.max_resample_times=1" in caplog.text
    samples, counts = collect(scripted_draw([[[0, 0], [1, 1]]]), target=2, unit=2, max_resample_times=0)
    assert len(samples) == 4 and counts.kept_groups == 0 and counts.topped_up_groups == 2


@pytest.mark.parametrize("args,dp,unit", [([], 1, 1), ([], 2, 1), (["--rollout.n", "3"], 2, 2),
                                          (["--train.steps_per_generation", "2", "--rollout.n", "2"], 2, 2),
                                          (["--pp", "2", "--rollout.n", "2", "--train.micro_batch_size", "4"], 1, 2)])
def test_unit_groups_split_evenly(args, dp, unit):
    cfg = load_config(os.path.join(ROOT, "examples", "tiny_cpu.yaml"), args, check_files=False)
    got = unit_groups(cfg, dp)
    assert got == unit
    t, n = cfg.train, cfg.rollout.n
    per_rank = got * n // (t.steps_per_generation * dp)
    assert got * n % (t.steps_per_generation * dp) == 0
    if cfg.parallel.pp > 1:
        assert per_rank % min(t.micro_batch_size, cfg.rollout.prompts_per_step * n // dp) == 0


@register_reward("constant_for_even_ids")
def _constant_for_even_ids(samples, tokenizer, **kw):
    """0.5 for every sample of an even-id prompt (no signal), the token fraction otherwise."""
    varying = token_fraction(samples, tokenizer, **kw)
    return [0.5 if s.info["id"] % 2 == 0 else v for s, v in zip(samples, varying)]


def test_trainer_drops_constant_groups_and_trains_a_full_batch(single_rank, tmp_path, tiny_dirs):
    from mgrpo.trainer import GRPOTrainer

    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = load_config(os.path.join(ROOT, "examples", "tiny_cpu.yaml"), [
        "--model.path", model, "--data.path", os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
        "--logging.output_dir", str(tmp_path / "run"), "--logging.progress_bar", "false", "--train.steps", "2",
        "--reward.funcs", "[constant_for_even_ids]", "--algorithm.dynamic_sampling", "true",
        "--algorithm.max_resample_times", "4"])
    cfg.model.tiny = None
    trainer = GRPOTrainer(cfg)
    drawn, batches = [], []
    real, real_collect = trainer.rollout_and_score, trainer.collect
    trainer.rollout_and_score = lambda step, round_=0: drawn.append(real(step, round_)) or drawn[-1]
    trainer.collect = lambda step: batches.append(real_collect(step)) or batches[-1]
    for step in range(2):
        drawn.clear()
        metrics = trainer.step(step)
        first_round_constant = {s.group_id for s in drawn[0] if s.info["id"] % 2 == 0}
        assert len(first_round_constant) >= 2  # the data interleaves even and odd ids
        assert metrics["dynamic_sampling/dropped_groups"] >= len(first_round_constant)
        assert metrics["dynamic_sampling/resample_rounds"] == len(drawn) - 1 >= 1
        assert metrics["dynamic_sampling/limit_hit"] == 0 and metrics["dynamic_sampling/kept_groups"] == 8
        trained = batches[-1][0]
        assert len(trained) == cfg.rollout.prompts_per_step * cfg.rollout.n
        assert not any(s.info["id"] % 2 == 0 for s in trained)
        assert len({s.group_id for s in trained}) == 8
    trainer.close()
