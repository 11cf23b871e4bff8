"""`mgrpo-train --help` is generated from the config dataclasses: every leaf field appears once with its type and
default, and a field's comment in mgrpo/config.py is its help line."""

import dataclasses
import typing


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_help_lists_every_field_with_type_default_and_meaning():
    from mgrpo.cli.help import config_help
    from mgrpo.config import Config

    text = config_help()
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    expected = ["--" + (n.replace("_", "-") if "." not in n else n) for n in _leaves(Config)]
    assert sorted(flags) == sorted(expected), sorted(set(flags) ^ set(expected))
    assert "  --algorithm.aggregation str|null (default None)\n      token-mean | seq-mean-token-mean" in text
    assert "  --logging.overwrite bool (default False)\n      an output_dir holding an earlier run" in text
    assert "  --rollout.n int (default 4)\n      samples per prompt (group size)" in text
    assert text.startswith("usage: mgrpo-train [--config FILE.yaml]")


def test_help_into_a_closed_pipe_is_quiet():
    """`mgrpo-train --help | head -3`: no BrokenPipeError traceback, exit 0. The reading end is closed before the
    tool writes, so every run meets the closed pipe (a real `head` races the writer)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, os.path.join(root, "launch", "train_grpo.py"), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader is gone before the tool has started
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
