"""report.png from a known metrics.jsonl: panel titles, one line per series with one point per step (checked
on the figure object before saving), a valid PNG, and one clear line with exit 2 when there are no metrics."""

import json
import subprocess
import sys

import pytest

from mgrpo.report import build_figure, panels, save_report, shown_panels

STEPS = 7


def _rows():
    rows = []
    for i in range(STEPS):
        row = {
            "step": i,
            "reward/mean": 0.1 * i,
            "reward/std": 0.2,
            "reward/failed": 0,
            "reward/accuracy": 0.05 * i,
            "reward/format": 1.0,
            "response_length/mean": 20 + i,
            "response_length/max": 32,
            "actor/kl_old": 0.001 * i,
            "actor/entropy": 5.0 - 0.1 * i,
            "actor/clip_frac": 0.01,
            "actor/clip_frac_low": 0.004,
            "actor/clip_frac_high": 0.006,
            "actor/grad_norm": 1.0 / (i + 1),
            "perf/tokens_per_s": 900.0,
            "timing/rollout": 0.5,
            "timing/old_logprob": 0.1,
            "timing/ref_logprob": 0.0,
            "timing/train": 0.3,
            "timing/sync": 0.05,
        }
        if i >= 2:
            row["actor/kl_ref"] = 0.01 * i  # a series that starts late keeps its own number of points
        rows.append(row)
    return rows


@pytest.fixture
def run_dir(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in _rows():
            f.write(json.dumps(row) + "\n")
    return tmp_path


def test_panels_hold_one_line_per_series_with_every_step():
    rows = _rows()
    fig = build_figure(rows)
    assert panels({k for r in rows for k in r})[0][1] == ["reward/mean", "reward/accuracy", "reward/format"]
    layout = [(title, series) for title, series, _ in shown_panels(rows)[0]]
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [title for title, _ in layout]
    for ax, (title, series) in zip(axes, layout):
        present = [k for k in series if any(k in r for r in rows)]
        if title.startswith("Time per step"):
            assert [c.get_label() for c in ax.collections] == [k.split("/", 1)[1] for k in present]
            continue
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert list(lines) == present, title
        for k in present:
            assert len(lines[k].get_xdata()) == sum(k in r for r in rows), (title, k)
            raw = [line for line in ax.get_lines() if line.get_label() == f"_raw {k}"]
            assert len(raw) == 1 and list(raw[0].get_ydata()) == [r[k] for r in rows if k in r]
    assert axes[2].get_lines()[-1].get_xdata()[0] == 2, "kl_ref starts at step 2"


def test_flat_panels_are_left_out_and_named_and_the_run_is_titled():
    """Clip fractions and throughput never move in _rows(): their panels go, one grey line lists their values;
    the title carries the run's name."""
    rows = _rows()
    fig = build_figure(rows, name="gsm8k-lr1e-6")
    titles = [ax.get_title() for ax in fig.axes]
    assert not any(t.startswith(("Clip fractions", "Throughput")) for t in titles), titles
    assert titles[0].startswith("Reward") and titles[-1].startswith("Time per step")
    assert fig._suptitle.get_text() == f"mgrpo run gsm8k-lr1e-6: {STEPS} steps"
    notes = [t.get_text() for t in fig.texts]
    assert any("actor/clip_frac=0.01" in n and "perf/tokens_per_s=900" in n for n in notes), notes
    rows[3]["actor/clip_frac"] = 0.02  # one step that clipped more brings the panel back
    assert any(t.startswith("Clip fractions") for t in (ax.get_title() for ax in build_figure(rows).axes))


def test_reward_mean_stays_visible_beside_an_identical_function():
    """One reward function: reward/accuracy equals reward/mean at every step. The mean is drawn (black, on top)
    and its label names the function instead of a second line hiding it."""
    rows = [{"step": i, "reward/mean": 0.1 * i, "reward/accuracy": 0.1 * i} for i in range(5)]
    ax = build_figure(rows).axes[0]
    labels = [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert labels == ["reward/mean = reward/accuracy"]
    rows[2]["reward/accuracy"] = 0.5  # a function that differs keeps its own line
    ax = build_figure(rows).axes[0]
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == [
        "reward/mean",
        "reward/accuracy",
    ]


def test_saved_png_is_valid(run_dir):
    import matplotlib.image as mpimg

    path = save_report(str(run_dir))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] >= 900 and img.shape[1] >= 1000  # 14 in wide at 100 dpi; 3 rows of panels at least


def test_cli_without_metrics_exits_2_with_one_line(tmp_path, run_dir):
    r = subprocess.run([sys.executable, "-m", "mgrpo.report", str(tmp_path / "empty")], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "metrics.jsonl: not found" in lines[0], r.stderr
    ok = subprocess.run([sys.executable, "-m", "mgrpo.report", str(run_dir)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("report.png")
