"""Validation: pass@k from the unbiased estimator equals a direct count over every k-subset of the same generations
(read back from val_generations.jsonl), the val/ reward means equal the file's, and the engine generated with the
weights just trained (the run's weight version)."""

import itertools
import json
import os

import pytest
from run_configs import tiny_run_config

from mgrpo.validation import pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def direct_pass_at_k(flags: list, k: int) -> float:
    subsets = list(itertools.combinations(flags, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n,c,k",
    [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (5, 4, 2), (8, 3, 8), (6, 6, 1), (6, 2, 2), (8, 3, 4), (10, 1, 5)],
)
def test_estimator_equals_counting_subsets(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(direct_pass_at_k([True] * c + [False] * (n - c), k), abs=1e-12)


@pytest.fixture(scope="module")
def val_run(single_rank, tiny_dirs, tmp_path_factory):
    from mgrpo.trainer import GRPOTrainer

    out = tmp_path_factory.mktemp("val") / "run"
    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = tiny_run_config(
        model,
        out,
        "--train.steps",
        "3",
        "--eval.path",
        os.path.join(ROOT, "examples/data/tiny_val.jsonl"),
        "--eval.interval",
        "2",
        "--eval.n",
        "4",
        "--eval.temperature",
        "1.0",
        "--eval.k",
        "[2, 4]",
        "--eval.pass_threshold",
        "0.05",
    )
    history = GRPOTrainer(cfg).fit()
    rows = [json.loads(line) for line in open(out / "val_generations.jsonl")]
    return history, rows, cfg


def test_val_metrics_equal_a_direct_computation_from_the_generations(val_run):
    history, rows, cfg = val_run
    assert ["val/pass@1" in h for h in history] == [False, True, True]  # every 2 steps and after the last
    for step, h in ((1, history[1]), (2, history[2])):
        mine = [r for r in rows if r["step"] == step]
        groups = {}
        for r in mine:
            assert r["passed"] == (r["score"] is not None and r["score"] >= cfg.eval.pass_threshold)
            groups.setdefault(r["group"], []).append(r["passed"])
        assert len(groups) == h["val/prompts"] == 8 and all(len(g) == 4 for g in groups.values())
        for k in (1, 2, 4):
            direct = sum(direct_pass_at_k(g, k) for g in groups.values()) / len(groups)
            assert h[f"val/pass@{k}"] == pytest.approx(direct, abs=1e-12), (step, k)
        assert h["val/reward/mean"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine), abs=1e-12)
        assert h["val/reward/token_fraction"] == pytest.approx(h["val/reward/mean"], abs=1e-12)
        assert {r["weight_version"] for r in mine} == {h["weight_version"]} == {step + 1}
        assert h["val/stale_samples"] == 0
    flags = [r["passed"] for r in rows]
    assert any(flags) and not all(flags), "the threshold must split the samples for the check to mean anything"
    assert history[1]["val/pass@1"] <= history[1]["val/pass@2"] <= history[1]["val/pass@4"]


def test_greedy_validation_is_deterministic_and_pass_at_1_is_the_pass_rate(single_rank, tiny_dirs, tmp_path):
    from mgrpo.trainer import GRPOTrainer

    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = tiny_run_config(
        model,
        tmp_path / "run",
        "--train.steps",
        "1",
        "--eval.path",
        os.path.join(ROOT, "examples/data/tiny_val.jsonl"),
        "--eval.interval",
        "1",
        "--eval.pass_threshold",
        "0.05",
    )  # the defaults: greedy, n = 1
    trainer = GRPOTrainer(cfg)
    first, second = trainer.validator.run(0, trainer.version), trainer.validator.run(1, trainer.version)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "val_generations.jsonl")]
    trainer.close()
    a, b = ([r["completion"] for r in rows if r["step"] == s] for s in (0, 1))
    assert len(a) == 8 and a == b, "greedy decoding of the same weights gives the same completions"
    assert first["val/pass@1"] == second["val/pass@1"] == sum(r["passed"] for r in rows[:8]) / 8
    assert set(first) == {k for k in second}
