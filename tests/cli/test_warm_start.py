"""The addition warm start: validation problems are never trained on, the loss falls, the folder is replaced whole
(with a marker), and the arithmetic example runs end to end (warm start, validation before training, the
accuracy reward through the worker processes)."""

import json
import os
import random
import subprocess
import sys

import pytest

from mgrpo.cli.warm_start import addition_pairs, held_out_pairs, warm_start

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_held_out_problems_are_never_drawn():
    val = held_out_pairs(os.path.join(ROOT, "examples", "data", "arith_val.jsonl"))
    assert len(val) == 64
    gen = addition_pairs(random.Random(0), val, 0, 99)
    assert not any(next(gen) in val for _ in range(20000))
    only = addition_pairs(random.Random(0), {(0, 0), (0, 1), (1, 0)}, 0, 1)
    assert {next(only) for _ in range(50)} == {(1, 1)}
    with pytest.raises(ValueError, match="held out"):
        next(addition_pairs(random.Random(0), {(0, 0)}, 0, 0))


def test_warm_start_lowers_the_loss_and_replaces_the_folder(tiny_dirs, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_dirs("warm_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=3), model)
    first = warm_start(str(model), 5, set(), progress=False)
    more = warm_start(str(model), 60, set(), progress=False)
    assert more["loss"] < first["loss"]
    marker = json.load(open(model / "mgrpo_warm_start.json"))
    assert marker["steps"] == 60 and os.path.isfile(model / "tokenizer.json")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".warm-")]


def test_arith_example_runs_end_to_end(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "arith_cpu.yaml"),
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny.warm_start.steps",
        "20",
        "--train.steps",
        "2",
        "--eval.interval",
        "2",
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.progress_bar",
        "false",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warm start: 20 steps of addition SFT" in r.stdout and "validation before training" in r.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [-1, 0, 1]
    assert "val/pass@1" in rows[0] and "val/pass@1" in rows[-1] and "reward/accuracy" in rows[1]
    assert rows[1]["reward/failed"] == 0
