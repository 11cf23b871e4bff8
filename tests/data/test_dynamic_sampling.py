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
    rounds = [
        [[1, 1], [0, 1], [0, 0], [1, 0]],  # 2 with signal
        [[0.5, 0.5], [0, 1], [1, 1], [0.2, 0.3]],
    ]  # 2 more
    samples, counts = collect(scripted_draw(rounds), target=4, unit=1, max_resample_times=3)
    assert sorted({s.group_id for s in samples}) == [1, 3, 101, 103]
    assert all(has_signal([s for s in samples if s.group_id == g]) for g in (1, 3, 101, 103))
    assert counts.metrics() == {
        "dynamic_sampling/kept_groups": 4.0,
        "dynamic_sampling/dropped_groups": 4.0,
        "dynamic_sampling/resample_rounds": 1.0,
        "dynamic_sampling/resampled_groups": 4.0,
        "dynamic_sampling/padding_groups": 0.0,
        "dynamic_sampling/trimmed_groups": 0.0,
        "dynamic_sampling/limit_hit": 0.0,
    }


def test_a_full_batch_is_trimmed_and_nan_rewards_do_not_count_as_signal():
    nan = float("nan")
    rounds = [[[1, nan], [0, 1], [0, 0], [1, 0]], [[0, 1], [0, 1], [0, 1], [0, 1]]]
    samples, counts = collect(scripted_draw(rounds), target=4, unit=2, max_resample_times=1)
    assert sorted({s.group_id for s in samples}) == [1, 3, 100, 101]
    assert counts.trimmed_groups == 2 and counts.dropped_groups == 2 and counts.limit_hit == 0


def test_at_the_limit_only_groups_with_signal_train_and_padding_is_marked(caplog):
    """The retry budget runs out with 1 group of signal (unit 2): the batch holds 2 groups, the second is padding
    (marked, so the batch trains nothing from it), and the warning says so. The former top-up trained the padding
    group like any other (its samples were unmarked): the marks are the negative control."""
    from mgrpo.data.dynamic_sampling import PADDING

    rounds = [[[1, 1], [0, 1], [0, 0], [1, 1]], [[1, 1], [1, 1], [0, 0], [0, 0]]]
    with caplog.at_level(logging.WARNING, logger="mgrpo.dynamic_sampling"):
        samples, counts = collect(scripted_draw(rounds), target=4, unit=2, max_resample_times=1)
    assert len({s.group_id for s in samples}) == 2 and 1 in {s.group_id for s in samples}
    assert counts.limit_hit == 1 and counts.padding_groups == 1 and counts.kept_groups == 1
    assert [bool(s.info.get(PADDING)) for s in samples if s.group_id == 1] == [False, False]
    assert all(s.info.get(PADDING) for s in samples if s.group_id != 1)
    assert "1 of 4 groups with reward signal after algorithm.max_resample_times=1" in caplog.text
    assert "train nothing" in caplog.text
    samples, counts = collect(scripted_draw([[[0, 0], [1, 1]]]), target=2, unit=2, max_resample_times=0)
    assert len(samples) == 4 and counts.kept_groups == 0 and counts.padding_groups == 2
    assert all(s.info.get(PADDING) for s in samples) and "this step trains nothing" in caplog.text


def test_signal_counts_only_samples_that_train():
    """With the overlong filter a truncated sample is neither right nor wrong: a group whose only differing reward
    belongs to a truncated sample has no signal."""
    group = [
        Sample([1], [2], [1], reward=r, group_id=0, finish_reason=f)
        for r, f in ((1.0, "stop"), (1.0, "stop"), (0.0, "length"))
    ]
    assert has_signal(group) and not has_signal(group, overlong_filter=True)


def test_padding_and_overlong_samples_leave_the_advantage_statistics(single_rank):
    """The batch the trainer builds: a padding group and an overlong-filtered sample get loss mask 0, weight 0 and
    NaN in trained_rewards, so the group mean and std the advantages use are those of the samples that train.
    Reference: the grpo formula by hand over the trained samples of the group. Negative control: the batch's raw
    rewards (the former input) give another advantage for the same sample."""
    import torch

    from mgrpo.data.batching import build_generation_batch
    from mgrpo.data.dynamic_sampling import PADDING
    from mgrpo.loss.advantages import STD_EPS, compute_advantages

    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            "m",
            "--rollout.n",
            "4",
            "--rollout.prompts_per_step",
            "2",
            "--algorithm.overlong_filter",
            "true",
        ],
        check_files=False,
    )
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    finish = ["stop", "stop", "stop", "length", "stop", "stop", "stop", "stop"]
    samples = [
        Sample(
            [5, 6],
            [7, 8, 9],
            [1, 1, 1],
            rollout_logprobs=[-1.0] * 3,
            reward=r,
            group_id=i // 4,
            finish_reason=f,
            info={PADDING: True} if i >= 4 else {},
        )
        for i, (r, f) in enumerate(zip(rewards, finish))
    ]
    batch = build_generation_batch(samples, cfg, pad_id=0, warn=False)
    assert batch.trained.tolist() == [True, True, True, False, False, False, False, False]
    assert all(sum(s.loss_mask) == 0 for s in samples[3:])
    adv = compute_advantages("grpo", batch.trained_rewards(), batch.group_ids, cfg.algorithm)
    kept = torch.tensor(rewards[:3], dtype=torch.float64)
    expect = (kept - kept.mean()) / (kept.std() + STD_EPS)
    assert torch.allclose(adv[:3].double(), expect.double(), atol=1e-6) and (adv[3:] == 0).all()
    raw = compute_advantages("grpo", batch.rewards, batch.group_ids, cfg.algorithm)
    assert abs(float(raw[0]) - float(expect[0])) > 0.1


@pytest.mark.parametrize(
    "args,dp,unit",
    [
        ([], 1, 1),
        ([], 2, 1),
        (["--rollout.n", "3"], 2, 2),
        (["--train.steps_per_generation", "2", "--rollout.n", "2"], 2, 2),
        (["--pp", "2", "--rollout.n", "2", "--train.micro_batch_size", "4"], 1, 2),
    ],
)
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
    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--logging.progress_bar",
            "false",
            "--train.steps",
            "2",
            "--reward.funcs",
            "[constant_for_even_ids]",
            "--algorithm.dynamic_sampling",
            "true",
            "--algorithm.max_resample_times",
            "4",
        ],
    )
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
