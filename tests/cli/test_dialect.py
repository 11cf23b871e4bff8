"""One flag dialect for the three tools (mgrpo/cli/dialect.py), and the console scripts the package installs."""

import os
import subprocess
import sys

import pytest

from mgrpo.cli.dialect import FlagParser, trainer_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def test_trainer_flags_take_either_joiner():
    argv = [
        "--rollout.max-tokens",
        "8",
        "--logging.output_dir=x",
        "--print_plan",
        "--world_size",
        "16",
        "--external_plugins",
        "p.py",
        "--reward.funcs",
        "[a-b, c_d]",
        "--tp",
        "2",
    ]
    assert trainer_flags(argv) == [
        "--rollout.max_tokens",
        "8",
        "--logging.output_dir=x",
        "--print-plan",
        "--world-size",
        "16",
        "--external-plugins",
        "p.py",
        "--reward.funcs",
        "[a-b, c_d]",
        "--tp",
        "2",
    ]


def test_a_dashed_dotted_flag_reaches_its_field():
    from mgrpo.config import load_config

    cfg = load_config(
        argv=trainer_flags(
            [
                "--config",
                os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
                "--rollout.max-tokens",
                "7",
                "--train.steps",
                "3",
            ]
        ),
        check_files=False,
    )
    assert (cfg.rollout.max_tokens, cfg.train.steps) == (7, 3)


def _parser():
    ap = FlagParser("tool", "doc")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--overwrite", action="store_true")
    return ap


def test_argparse_tools_take_either_joiner_and_pass_the_rest_through():
    args, extra = _parser().parse_known_args(
        ["--max_shard_size=1GB", "--overwrite", "--", "--tensor_parallel_size", "2"]
    )
    assert (args.max_shard_size, args.overwrite, extra) == ("1GB", True, ["--tensor_parallel_size", "2"])


def test_a_wrong_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--max-shard-sise", "1GB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: tool: unrecognized arguments: --max-shard-sise 1GB (see tool --help)"]


@pytest.mark.parametrize(
    "script,launch,first",
    [
        ("mgrpo-train", "train_grpo.py", "usage: mgrpo-train [--config FILE.yaml]"),
        ("mgrpo-convert", "convert_to_hf.py", "usage: mgrpo-convert [-h] --checkpoint CHECKPOINT"),
        ("mgrpo-serve", "rollout_server.py", "usage: mgrpo-serve [-h] --model MODEL --port PORT"),
    ],
)
def test_console_scripts_and_launch_files_are_the_same_tool(script, launch, first):
    """pyproject.toml's [project.scripts], installed by scripts/setup.sh (pip install -e), and launch/ for a
    checkout: the same --help."""
    path = os.path.join(BIN, script)
    assert os.path.isfile(path), f"{path} missing: run `pip install -e .` (scripts/setup.sh does)"
    env = {**os.environ, "PYTHONPATH": ROOT}
    installed = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120, env=env)
    checkout = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", launch), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert installed.returncode == checkout.returncode == 0, installed.stderr + checkout.stderr
    assert installed.stdout.startswith(first)
    assert installed.stdout == checkout.stdout
