"""report.png: a run's curves on one page, readable at a glance (shared step axis, lightly smoothed lines over
the faint raw values, units in the titles) and a stacked breakdown of where each step's time went. The run's
name heads the page; a panel whose every series stayed constant (a KL of zero without a reference, no clipping)
is left out and listed in one line at the bottom; reward/mean is drawn on top, and a per-function reward that
equals it at every step is named in its label instead of hiding it.

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
TIME_PHASES = [
    "timing/rollout",
    "timing/old_logprob",
    "timing/ref_logprob",
    "timing/train",
    "timing/sync",
    "timing/other",
]


def panels(keys) -> list:
    """(title, [series]) in display order; the reward panel gains one series per reward function."""
    per_function = sorted(
        k for k in keys if k.startswith("reward/") and k not in ("reward/mean", "reward/std", "reward/failed")
    )
    moe = (
        [
            (
                "Experts (MoE): load balance and router agreement",
                ["moe/tokens_per_expert_cv", "moe/max_load_over_mean", "moe/aux_loss", "moe/router_agreement"],
            )
        ]
        if any(k.startswith("moe/") for k in keys)
        else []
    )
    ahead = (
        [
            (
                "Asynchronous rollout: staleness (versions), drops, waits (s)",
                [
                    "async/staleness_mean",
                    "async/staleness_max",
                    "async/discarded",
                    "timing/wait_rollout",
                    "timing/wait_train",
                ],
            )
        ]
        if any(k.startswith("async/") for k in keys)
        else []
    )
    return [
        ("Reward (mean per step)", ["reward/mean"] + per_function),
        ("Response length (tokens)", ["response_length/mean", "response_length/max"]),
        ("KL to old and reference policy (nats)", ["actor/kl_old", "actor/kl_ref"]),
        ("Entropy (nats per token)", ["actor/entropy"]),
        (
            "Clip fractions (share of loss tokens)",
            ["actor/clip_frac", "actor/clip_frac_low", "actor/clip_frac_high", "actor/dual_clip_frac"],
        ),
        ("Gradient norm (before clipping)", ["actor/grad_norm"]),
        ("Throughput (response tokens / s)", ["perf/tokens_per_s"]),
        *moe,
        *ahead,
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


ALWAYS_SHOWN = ("Reward", "Time per step")  # the run's outcome and its cost, even when flat


def _values(rows: list, key: str) -> list:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def _constant(rows: list, key: str):
    """The value a series held at every step, or None if it varied (or was never logged)."""
    values = _values(rows, key)
    if not values or any(not math.isclose(v, values[0], rel_tol=1e-9, abs_tol=1e-12) for v in values):
        return None
    return values[0]


def _equal_series(rows: list, a: str, b: str) -> bool:
    pairs = [(r.get(a), r.get(b)) for r in rows if r.get(a) is not None or r.get(b) is not None]
    return bool(pairs) and all(
        x is not None and y is not None and math.isclose(float(x), float(y), abs_tol=1e-12) for x, y in pairs
    )


def shown_panels(rows: list) -> tuple[list, list]:
    """(panels to draw, 'key=value' of the constant series whose panels were left out). A per-function reward
    equal to reward/mean at every step is dropped from the reward panel (reward/mean's label names it)."""
    keys = {k for r in rows for k in r}
    shown, flat = [], []
    for title, series in panels(keys):
        present = [k for k in series if k in keys]
        if title.startswith("Reward"):
            same = [k for k in present if k != "reward/mean" and _equal_series(rows, k, "reward/mean")]
            series = [k for k in series if k not in same]
            shown.append((title, series, {"reward/mean": "reward/mean" + "".join(f" = {k}" for k in same)}))
        elif title.startswith(ALWAYS_SHOWN) or not present or any(_constant(rows, k) is None for k in present):
            shown.append((title, series, {}))
        else:
            flat += [f"{k}={_constant(rows, k):.4g}" for k in present]
    return shown, flat


def build_figure(rows: list, name: str | None = None):
    """The report as a matplotlib Figure (not saved): one axis per shown panel, titles as in `panels()`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in rows for k in r}
    layout, flat = shown_panels(rows)
    rows_n = math.ceil(len(layout) / 2)
    fig, axes = plt.subplots(rows_n, 2, figsize=(14, 3.25 * rows_n), sharex=True, squeeze=False)
    for ax, (title, series, labels) in zip(axes.flat, layout):
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        present = [k for k in series if k in keys]
        if title.startswith("Time per step"):
            steps = [r["step"] for r in rows]
            if present:
                ax.stackplot(
                    steps,
                    *[[float(r.get(k, 0.0)) for r in rows] for k in present],
                    labels=[k.split("/", 1)[1] for k in present],
                    alpha=0.8,
                )
        else:
            for i, k in enumerate(present):
                pts = [(r["step"], float(r[k])) for r in rows if k in r and r[k] is not None]
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                color, top = ("black", 3) if k == "reward/mean" else (f"C{i}", 2)
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1, label=f"_raw {k}", zorder=top)
                ax.plot(
                    xs, smooth(ys), color=color, linewidth=2.2 if top == 3 else 1.6, label=labels.get(k, k), zorder=top
                )
        if present:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(layout) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"mgrpo run {name}: {len(rows)} steps" if name else f"mgrpo run: {len(rows)} steps", fontsize=13)
    if flat:
        fig.text(
            0.01,
            0.002,
            "constant over the run (panels left out): " + ", ".join(flat),
            fontsize=8,
            color="grey",
            ha="left",
            va="bottom",
            wrap=True,
        )
    fig.tight_layout(rect=(0, 0.02 if flat else 0, 1, 1))
    return fig


def save_report(run_dir: str, output: str | None = None) -> str:
    """Write report.png (atomically) from run_dir/metrics.jsonl; returns its path."""
    import matplotlib.pyplot as plt

    fig = build_figure(read_metrics(run_dir), name=os.path.basename(os.path.normpath(os.path.abspath(run_dir))))
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
