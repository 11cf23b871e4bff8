"""--external-plugins: a plugin file loaded from a temp dir registers a reward, an ms-swift ORM, a scheduler, an
environment and a policy loss, and one training run uses each by name; a second plugin's isolated reward hangs
once and is killed at reward.timeout_s while the run goes on. Bad plugin paths are one line and exit 2."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "train_grpo.py")


def _env():
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }


def test_plugin_file_registers_all_kinds_and_a_run_uses_them(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "plugin.py"), plugins / "my_plugin.py")
    (plugins / "hangs_once.py").write_text(
        textwrap.dedent(f"""
        import os, time
        from mgrpo.rewards import register_reward

        @register_reward("hangs_once", per_sample=True, isolated=True)
        def hangs_once(completion, **_):
            flag = {str(tmp_path / "hung")!r}
            if not os.path.exists(flag):
                open(flag, "w").close()
                time.sleep(10 ** 6)
            return 0.0
    """)
    )
    cmd = [
        sys.executable,
        LAUNCH,
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu_gym.yaml"),
        "--external-plugins",
        f"{plugins / 'my_plugin.py'},{plugins / 'hangs_once.py'}",
        "--reward.funcs",
        "[short_answer, swift_digits, env_reward, hangs_once]",
        "--reward.weights",
        "null",
        "--reward.timeout_s",
        "2",
        "--rollout.scheduler",
        "countdown_gym",
        "--algorithm.policy_loss",
        "ppo_clip_halved",
        "--train.steps",
        "2",
        "--rollout.prompts_per_step",
        "4",
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.progress_bar",
        "false",
        "--logging.completions_interval",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [0, 1]
    for name in ("short_answer", "swift_digits", "env_reward"):
        assert f"reward/{name}" in rows[0], name
    assert rows[0]["reward/failed"] == 1 and rows[1]["reward/failed"] == 0  # the hung call, killed at 2 s
    assert rows[0]["rollout/num_turns/mean"] > 1  # the plugin's countdown environment answered
    completions = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert any("Count down from" in c["prompt"] for c in completions)
    saved = open(tmp_path / "run" / "config.yaml").read()
    assert "ppo_clip_halved" in saved and "my_plugin.py" in saved


def test_bad_plugin_paths_and_unknown_names_are_one_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    for extra, expected in (
        (["--external-plugins", str(tmp_path / "missing.py")], "missing.py' not found"),
        (["--external-plugins", str(broken)], "broken.py raised RuntimeError: oops"),
        (["--reward.funcs", "[acuracy]"], "did you mean 'accuracy'?"),
    ):
        r = subprocess.run(
            [
                sys.executable,
                LAUNCH,
                "--config",
                os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
                "--model.path",
                str(tmp_path / "model"),
                "--model.tiny",
                *extra,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=_env(),
            timeout=300,
        )
        assert r.returncode == 2 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
