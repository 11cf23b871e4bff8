"""The README's commands as written: the main job runs and learns (its own last line), the console scripts it
names exist, and every relative link in README.md and docs/ points at a file of the repository."""

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def readme_command(startswith: str) -> list:
    for line in open(README):
        if line.startswith(startswith):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"README.md has no line starting {startswith!r}")


def test_the_readme_main_job_learns(tmp_path):
    """`.venv/bin/python launch/train_grpo.py --config examples/tiny_cpu.yaml`, run from the checkout with this
    interpreter; only its output and model folders are moved to tmp_path (a rerun refuses a used output folder)."""
    cmd = readme_command(".venv/bin/python launch/train_grpo.py --config examples/tiny_cpu.yaml")
    assert cmd[1:] == ["launch/train_grpo.py", "--config", "examples/tiny_cpu.yaml"], cmd
    out = subprocess.run(
        [
            sys.executable,
            *cmd[1:],
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--model.path",
            str(tmp_path / "model"),
            "--model.tiny",
            "--logging.progress_bar",
            "false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="2"),  # the README's machine: 2 cores (the suite runs on 1 thread)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.match(r"reward/mean first5=([\d.]+) last5=([\d.]+) metrics=", last)
    assert m, last
    first, final = float(m.group(1)), float(m.group(2))
    assert first < 0.2 and final > 0.9, last  # README: first5=0.0654 last5=0.9964
    # the README's figure, to the rounding another CPU's kernels give (AVX-512 machines here gave last5 0.9964
    # and 0.9970 from the same code: a few sampled tokens differ); learning that changed moves it further
    shown = re.search(r"`reward/mean first5=([\d.]+) last5=([\d.]+)`", open(README).read())
    assert shown and abs(first - float(shown[1])) <= 0.005 and abs(final - float(shown[2])) <= 0.005, (
        f"the README's figure ({shown and shown[0]}) no longer matches the main job's own last line: update README.md"
    )


def test_every_relative_link_points_at_a_file():
    docs = os.path.join(ROOT, "docs")
    pages = [README] + [os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(page).read()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), target))):
                broken.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert broken == []
    assert len(open(README).read().splitlines()) <= 250
