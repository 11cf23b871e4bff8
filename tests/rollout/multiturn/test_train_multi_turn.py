"""End to end through launch/train_grpo.py: short training runs with GymScheduler (guess the number, several
turns, environment reward) and with ToolCallScheduler, on the HF engine."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def launch(config, tmp_path, *extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", config),
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.progress_bar",
        "false",
        "--logging.completions_interval",
        "1",
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    completions = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    return rows, completions


def test_gym_scheduler_trains(tmp_path):
    rows, completions = launch("tiny_cpu_gym.yaml", tmp_path, "--train.steps", "3")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["weight_version"] == 3
    for r in rows:
        assert r["rollout/num_turns/mean"] > 1.5 and r["rollout/num_turns/max"] == 3
        assert r["rollout/env_tokens/mean"] > 0 and r["rollout/trajectories_failed"] == 0
        assert r["rollout/logprobs_dropped"] == 0 and "reward/env_reward" in r and r["actor/grad_norm"] > 0
    # the environment's observations are in the trajectories, as new user turns after the model's guesses
    assert any("the number is" in c["completion"] or "Reply with a number" in c["completion"] for c in completions)
    assert all(c["prompt"].count("Guess the number between 1 and 20") == 1 for c in completions)


def test_tool_call_scheduler_trains(tmp_path):
    rows, _ = launch("tiny_cpu_tools.yaml", tmp_path, "--train.steps", "2", "--rollout.max_turns", "2")
    assert [r["step"] for r in rows] == [0, 1] and rows[-1]["weight_version"] == 2
    assert all(1 <= r["rollout/num_turns/mean"] <= 2 and r["rollout/trajectories_failed"] == 0 for r in rows)


def test_a_raising_trajectory_is_left_out_and_the_step_goes_on(single_rank, tmp_path, tiny_dirs):
    from mgrpo.config import load_config
    from mgrpo.rollout.multiturn import GymScheduler, register_scheduler
    from mgrpo.trainer import GRPOTrainer

    @register_scheduler("flaky_gym_for_test")
    class FlakyGym(GymScheduler):
        def step(self, infer_request, response_choice, current_turn):
            if infer_request.uuid.endswith("-1"):  # sample 1 of every group
                raise ConnectionError("environment server went away")
            return super().step(infer_request, response_choice, current_turn)

    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu_gym.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples/data/tiny_guess.jsonl"),
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--logging.progress_bar",
            "false",
            "--rollout.scheduler",
            "flaky_gym_for_test",
            "--rollout.prompts_per_step",
            "4",
            "--train.steps",
            "1",
        ],
    )
    cfg.model.tiny = None
    trainer = GRPOTrainer(cfg)
    try:
        metrics = trainer.step(0)
    finally:
        trainer.close()
    assert metrics["rollout/trajectories_failed"] == 4 and metrics["reward/failed"] == 4
    assert metrics["actor/grad_norm"] > 0 and metrics["rollout/num_turns/mean"] > 1
