"""Every sink gets the same keys: metrics.jsonl, TensorBoard event files (read back with TensorBoard's own reader)
and a wandb offline run (read back from its .wandb file); plus config.yaml, completions.jsonl and report.png."""

import json
import os

import pytest
import yaml
from wandb_offline import read_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2
EXPECTED = [
    "reward/mean",
    "reward/std",
    "reward/token_fraction",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "actor/entropy",
    "actor/kl_old",
    "actor/kl_ref",
    "actor/clip_frac",
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/grad_norm",
    "actor/lr",
    "actor/loss",
    "perf/tokens_per_s",
    "timing/rollout",
    "timing/old_logprob",
    "timing/ref_logprob",
    "timing/train",
    "timing/sync",
    "timing/save",
    "timing/other",
    "timing/step",
    "weight_version",
]
VAL = [
    "val/pass@1",
    "val/pass@2",
    "val/reward/mean",
    "val/reward/token_fraction",
    "val/response_length/mean",
    "timing/val",
]  # validation after the last step only


@pytest.fixture(scope="module")
def run_dir(single_rank, tiny_dirs, tmp_path_factory):
    from mgrpo.config import load_config
    from mgrpo.trainer import GRPOTrainer

    out = tmp_path_factory.mktemp("logging") / "run"
    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    os.environ.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
            "--logging.output_dir",
            str(out),
            "--logging.progress_bar",
            "false",
            "--train.steps",
            str(STEPS),
            "--logging.tensorboard",
            "true",
            "--logging.wandb.mode",
            "offline",
            "--logging.wandb.project",
            "mgrpo-test",
            "--logging.completions_interval",
            "1",
            "--algorithm.kl_coef",
            "0.01",
            "--eval.interval",
            "5",
            "--eval.path",
            os.path.join(ROOT, "examples/data/tiny_val.jsonl"),
            "--eval.n",
            "2",
            "--eval.temperature",
            "1",
            "--eval.k",
            "[2]",
        ],
    )
    cfg.model.tiny = None
    history = GRPOTrainer(cfg).fit()
    return str(out), history


def test_metrics_jsonl_has_the_names_users_know(run_dir):
    out, history = run_dir
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for key in EXPECTED:
        assert all(key in r for r in rows), f"{key} missing from metrics.jsonl"
    for key in VAL:
        assert [key in r for r in rows] == [False] * (STEPS - 1) + [True], key
    assert rows == [{"step": i, **h} for i, h in enumerate(history)]
    for r in rows:  # the step's wall clock: every phase (validation included), plus what no phase saw
        phases = sum(v for k, v in r.items() if k.startswith("timing/") and k not in ("timing/step", "timing/other"))
        assert r["timing/other"] >= 0 and r["timing/step"] == pytest.approx(phases + r["timing/other"])
    assert rows[0]["actor/lr"] > 0 and rows[0]["actor/entropy"] > 0


def test_tensorboard_event_files_read_back(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, history = run_dir
    acc = EventAccumulator(os.path.join(out, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(EXPECTED) | set(VAL) <= tags
    assert tags == {k for h in history for k in h if not isinstance(h[k], bool)}
    for key in VAL:
        assert [e.step for e in acc.Scalars(key)] == [STEPS - 1], key
        assert acc.Scalars(key)[0].value == pytest.approx(history[-1][key], rel=1e-6)
    for key in EXPECTED:
        events = acc.Scalars(key)
        assert [e.step for e in events] == list(range(STEPS)), key
        assert [e.value for e in events] == pytest.approx([float(h[key]) for h in history], rel=1e-6), key


def test_wandb_offline_run_has_the_same_keys(run_dir):
    out, history = run_dir
    rows = read_history(out)
    assert len(rows) == STEPS
    for row, h in zip(rows, history):
        assert {k for k in row if not k.startswith("_")} == set(h)
        assert row["reward/mean"] == pytest.approx(h["reward/mean"])
    assert set(VAL) <= set(rows[-1]) and rows[-1]["val/pass@1"] == pytest.approx(history[-1]["val/pass@1"])
    assert [r["_step"] for r in rows] == list(range(STEPS))


def test_config_completions_and_report_are_written(run_dir):
    from mgrpo.config import load_config

    out, _ = run_dir
    cfg = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    assert cfg["logging"]["wandb"]["mode"] == "offline" and cfg["algorithm"]["kl_coef"] == 0.01
    reloaded = load_config(os.path.join(out, "config.yaml"), check_files=False)
    assert reloaded.algorithm.kl_coef == 0.01, "config.yaml loads back as a config"
    rows = [json.loads(line) for line in open(os.path.join(out, "completions.jsonl"))]
    assert len(rows) == STEPS * 64 and {r["step"] for r in rows} == set(range(STEPS))
    r = rows[0]
    assert {"prompt", "completion", "rewards", "advantage", "finish_reason", "weight_version"} <= set(r)
    assert "<|im_start|>" in r["prompt"] and "token_fraction" in r["rewards"]
    assert {x["finish_reason"] for x in rows} <= {"stop", "length"}
    with open(os.path.join(out, "report.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_warnings_print_above_the_progress_bar(tmp_path, capsys):
    """While a run's bar is up, mgrpo's warnings go through tqdm.write (a line of their own above the bar, not
    torn into it), named by logger, once each even with a second run logger open; closing gives the handlers
    back."""
    import logging

    from tqdm.contrib.logging import _TqdmLoggingHandler

    from mgrpo.config import load_config
    from mgrpo.run_logger import RunLogger

    def cfg(name):
        return load_config(
            os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
            ["--logging.output_dir", str(tmp_path / name), "--logging.tensorboard", "false"],
            check_files=False,
        )

    mgrpo_log = logging.getLogger("mgrpo")
    for h in [h for h in mgrpo_log.handlers if isinstance(h, _TqdmLoggingHandler)]:
        mgrpo_log.removeHandler(h)  # an earlier test's run logger that was never closed
    before = list(mgrpo_log.handlers)
    first, second = RunLogger(cfg("a"), enabled=True), RunLogger(cfg("b"), enabled=True)
    try:
        assert [type(h) for h in mgrpo_log.handlers if h not in before] == [_TqdmLoggingHandler]
        capsys.readouterr()
        logging.getLogger("mgrpo.rewards").warning("reward 'x' failed for 2 samples")
        err = capsys.readouterr().err
        assert err.count("mgrpo.rewards: WARNING: reward 'x' failed for 2 samples\n") == 1, err
    finally:
        second.close()
        first.close()
    assert mgrpo_log.handlers == before
