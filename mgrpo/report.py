"""report.png: a run's curves on one page, readable at a glance (shared step axis, lightly smoothed lines over
the faint raw values, units in the titles) and a stacked breakdown of where each step's time went.

    python -m mgrpo.report OUTPUT_DIR [--output report.png]

Reads OUTPUT_DIR/metrics.jsonl; written at the end of every run (logging.report). matplotlib, Agg backend.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from mgrpo.fsutil import JsonlLineError, read_jsonl

SMOOTHING = 0.6  # exponential moving average weight of the previous value (TensorBoard-style, light)
TIME_PHASES = ["timing/rollout", "timing/old_logprob", "timing/ref_logprob", "timing/train", "timing/sync",
               "timing/other"]


def panels(keys) -> list:
    """(title, [series]) in display order; the reward panel gains one series per reward function."""
    per_function = sorted(k for k in keys if k.startswith("reward/") and k not in ("reward/mean", "reward/std",
                                                                                    "reward/failed"))
    moe = [("Experts (MoE): load balance and router agreement", ["moe/tokens_per_expert_cv", "moe/max_load_over_mean",
                                                                   "moe/aux_loss", "moe/router_agreement"])] \
        if any(k.startswith("moe/") for k in keys) else []
    ahead = [("Asynchronous rollout: staleness (versions), drops, waits (s)",
              ["async/staleness_mean", "async/staleness_max", "async/discarded", "timing/wait_rollout",
               "timing/wait_train"])] if any(k.startswith("async/") for k in keys) else []
    return [
        ("Reward (mean per step)", ["reward/mean"] + per_function),
        ("Response length (tokens)", ["response_length/mean", "response_length/max"]),
        ("KL to old and reference policy (nats)", ["actor/kl_old", "actor/kl_ref"]),
        ("Entropy (nats per token)", ["actor/entropy"]),
        ("Clip fractions (share of loss tokens)", ["actor/clip_frac", "actor/clip_frac_low", "actor/clip_frac_high",
                                                   "actor/dual_clip_frac"]),
        ("Gradient norm (before clipping)", ["actor/grad_norm"]),
        ("Throughput (response tokens / s)", ["perf/tokens_per_s"]),
        *moe, *ahead,
        ("Time per step (s, stacked)", TIME_PHASES),
    ]


class ReportError(ValueError):
    """No usable metrics in the run folder; the message names the file and the fix."""


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ReportError(f"{path}: not found; point at a run's logging.output_dir (it holds metrics.jsonl)")
    try:
        rows = read_jsonl(path)
    except JsonlLineError as exc:
        raise ReportError(f"{path}: line {exc.line} is not JSON; the file is damaged") from None
    if not rows:
        raise ReportError(f"{path}: no steps logged yet; run at least one step")
    return rows


def smooth(values: list) -> list:
    out, last = [], None
    for v in values:
        last = v if last is None or not math.isfinite(last) else SMOOTHING * last + (1 - SMOOTHING) * v
        out.append(last)
    return out


def build_figure(rows: list):
    """The report as a matplotlib Figure (not saved): one axis per panel, titles as in `panels()`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in rows for k in r}
    layout = panels(keys)
    rows_n = math.ceil(len(layout) / 2)
    fig, axes = plt.subplots(rows_n, 2, figsize=(14, 3.25 * rows_n), sharex=True, squeeze=False)
    for ax, (title, series) in zip(axes.flat, layout):
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        present = [k for k in series if k in keys]
        if title.startswith("Time per step"):
            steps = [r["step"] for r in rows]
            if present:
                ax.stackplot(steps, *[[float(r.get(k, 0.0)) for r in rows] for k in present],
                             labels=[k.split("/", 1)[1] for k in present], alpha=0.8)
        else:
            for i, k in enumerate(present):
                pts = [(r["step"], float(r[k])) for r in rows if k in r and r[k] is not None]
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                color = f"C{i}"
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1, label=f"_raw {k}")
                ax.plot(xs, smooth(ys), color=color, linewidth=1.8, label=k)
        if present:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    for ax in list(axes.flat)[len(layout):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"mgrpo run: {len(rows)} steps", fontsize=13)
    fig.tight_layout()
    return fig


def save_report(run_dir: str, output: str | None = None) -> str:
    """Write report.png (atomically) from run_dir/metrics.jsonl; returns its path."""
    import matplotlib.pyplot as plt

    fig = build_figure(read_metrics(run_dir))
    output = output or os.path.join(run_dir, "report.png")
    tmp = output + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, output)
    return output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mgrpo.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run's logging.output_dir (holds metrics.jsonl)")
    ap.add_argument("--output", help="where to write the PNG (default RUN_DIR/report.png)")
    args = ap.parse_args(argv)
    try:
        path = save_report(args.run_dir, args.output)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
