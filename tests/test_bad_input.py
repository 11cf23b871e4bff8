"""Bad input through the real launcher (the newcomer's first hour): each case exits 2 with one line naming the field
or file and the fix, before any process group or output (the output folder stays absent, or untouched); a reward
function that fails every sample stops the run with its first exception; the converter's shard size parses with
transformers' units."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "train_grpo.py")
TINY = os.path.join(ROOT, "examples", "tiny_cpu.yaml")


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY", "WANDB_MODE")
    }
    return {**env, **extra}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mgrpo.models.tiny import make_tiny_hf

    return make_tiny_hf(
        str(tmp_path_factory.mktemp("bad_input") / "model"),
        family="qwen2",
        vocab_size=300,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
        seed=0,
    )


def launch(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, LAUNCH, *args], capture_output=True, text=True, cwd=ROOT, env=env or _env(), timeout=timeout
    )


class _Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


@pytest.fixture
def check_only(capsys, monkeypatch):
    """The launcher's `main` in this process, for input refused before any process group (no start-up cost)."""
    import importlib.util
    import signal

    spec = importlib.util.spec_from_file_location("mgrpo_launch_train", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key in ("WANDB_API_KEY", "WANDB_MODE", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    handler = signal.getsignal(signal.SIGINT)

    def run(*args):
        capsys.readouterr()
        try:
            rc = module.main(list(args))
        finally:
            signal.signal(signal.SIGINT, handler)
        return _Result(rc, capsys.readouterr().err)

    return run


def one_line(r, expected: str):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and expected in lines[0], (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr


def test_output_dir_under_a_file(tmp_path, model, check_only):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "run"
    one_line(
        check_only("--config", TINY, "--model.path", model, "--logging.output_dir", str(out)),
        f"logging.output_dir='{out}' is under {tmp_path / 'afile'}, which is a file, not a folder",
    )


def test_save_dir_that_is_a_file(tmp_path, model, check_only):
    (tmp_path / "ckpt").write_text("x")
    one_line(
        check_only(
            "--config",
            TINY,
            "--model.path",
            model,
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--checkpoint.save_dir",
            str(tmp_path / "ckpt"),
            "--checkpoint.save_interval",
            "1",
        ),
        f"checkpoint.save_dir='{tmp_path / 'ckpt'}' is a file, not a folder",
    )
    assert not (tmp_path / "run").exists()


def test_wandb_online_without_a_key_says_how_to_run_offline(tmp_path, model, check_only, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    r = check_only(
        "--config",
        TINY,
        "--model.path",
        model,
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.wandb",
        "{project: x}",
    )
    one_line(r, "no wandb API key was found (WANDB_API_KEY or `wandb login`); set --logging.wandb.mode offline")
    assert not (tmp_path / "run").exists()


def test_a_reused_output_folder_is_refused_unless_overwrite(tmp_path, model, check_only):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "tensorboard").mkdir()
    one_line(
        check_only("--config", TINY, "--model.path", model, "--logging.output_dir", str(out)),
        f"logging.output_dir='{out}' already holds a run (metrics.jsonl, tensorboard); choose a new folder, "
        f"continue that run with --resume, or pass --logging.overwrite true",
    )
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n', "untouched"
    r = launch(
        "--config",
        TINY,
        "--model.path",
        model,
        "--logging.output_dir",
        str(out),
        "--logging.overwrite",
        "true",
        "--train.steps",
        "1",
        "--logging.report",
        "false",
        "--logging.tensorboard",
        "false",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [0] and not (out / "tensorboard").exists()


def test_a_reward_that_always_raises_stops_the_run_naming_it(tmp_path, model):
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text(
        "from mgrpo.rewards import register_reward\n\n@register_reward('always_raises')\n"
        "def always_raises(samples, tokenizer, **_):\n    raise ValueError('judge is down')\n"
    )
    r = launch(
        "--config",
        TINY,
        "--model.path",
        model,
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--external-plugins",
        str(plugin),
        "--reward.funcs",
        "[always_raises]",
        "--train.steps",
        "3",
        "--logging.completions_interval",
        "1",
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert "every one of the 64 samples failed its reward" in errors[0]
    assert "reward 'always_raises': ValueError: judge is down" in errors[0]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl") or not open(tmp_path / "run" / "metrics.jsonl").read()


def test_a_plugin_cannot_silently_replace_a_builtin_reward(tmp_path, model, check_only):
    plugin = tmp_path / "dup.py"
    plugin.write_text(
        "from mgrpo.rewards import register_reward\n\n@register_reward('token_fraction')\n"
        "def mine(samples, tokenizer, **_):\n    return [1.0] * len(samples)\n"
    )
    one_line(
        check_only(
            "--config",
            TINY,
            "--model.path",
            model,
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--external-plugins",
            str(plugin),
        ),
        "reward 'token_fraction' is registered twice: at mgrpo/rewards/registry.py:",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "content,expected",
    [
        ("", "is empty; it needs at least one row with a prompt"),
        ('{"prompt": "a"}\n{"prompt": \n', "line 2 is not JSON"),
    ],
)
def test_empty_or_malformed_data_file(tmp_path, model, content, expected, check_only):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    r = check_only(
        "--config", TINY, "--model.path", model, "--logging.output_dir", str(tmp_path / "run"), "--data.path", str(data)
    )
    one_line(r, f"data.path='{data}'")
    assert expected in r.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--config"], "--config needs a YAML file: --config examples/tiny_cpu.yaml"),
        (
            ["--config", TINY, "--algorithm.policy_loss", "ppo"],
            "algorithm.policy_loss='ppo' is unknown; did you mean 'ppo_clip'?",
        ),
        (
            ["--config", os.path.join(ROOT, "examples", "qwen72b.yaml")],
            "examples/gsm8k.yaml's header makes one from GSM8K in one command",
        ),
    ],
)
def test_flags_and_placeholders(args, expected, check_only):
    r = check_only(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) <= 2  # "config error" header line + the problem


@pytest.mark.parametrize(
    "size,expect", [("5GB", 5_000_000_000), ("5GiB", 5 << 30), ("500MB", 500_000_000), ("1048576", 1 << 20)]
)
def test_converter_sizes_use_transformers_units(size, expect):
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    from mgrpo.cli.convert import parse_size

    assert parse_size(size) == expect


@pytest.mark.parametrize("size", ["abc", "1.5GB", "0"])
def test_converter_bad_size_is_one_line(tmp_path, size):
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "convert_to_hf.py"),
            "--checkpoint",
            str(tmp_path),
            "--output",
            str(tmp_path / "hf"),
            "--max-shard-size",
            size,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=120,
    )
    one_line(r, f"--max-shard-size '{size}': use a positive size such as 5GB, 500MB or 5GiB")
    assert not (tmp_path / "hf").exists()
