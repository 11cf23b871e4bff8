"""Stopping a run by hand, on the real launcher: SIGINT (Ctrl-C) in the middle of a rollout stops the run within a
few seconds with exit 130, no step after the interrupted one is logged, and the line says how many steps are
complete; a second Ctrl-C exits at once. Before the fix the first Ctrl-C was swallowed by asyncio's wait_for and
the run went on to its last step with exit 0."""

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MGRPO_TEST_PAUSE")
    }
    marker = tmp_path / "mark"
    env.update(MGRPO_TEST_MARK="rollout:1", MGRPO_TEST_PAUSE_MARKER=str(marker))
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--train.steps",
        "6",
        "--rollout.max_tokens",
        "200",
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.progress_bar",
        "false",
        "--logging.report",
        "false",
        "--checkpoint.save_dir",
        str(tmp_path / "ckpt"),
        "--checkpoint.save_interval",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "the run never reached step 1's rollout"
        time.sleep(0.05)
    return proc


def _rows(tmp_path) -> list:
    return open(tmp_path / "run" / "metrics.jsonl").read().splitlines()


def test_one_ctrl_c_mid_rollout_stops_cleanly_with_130(tmp_path):
    proc = _start(tmp_path)
    time.sleep(0.3)  # inside step 1's generation
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.time() - sent
    print(f"SIGINT mid-rollout: exit {proc.returncode} after {took:.2f} s; last line: {err.strip().splitlines()[-1]}")
    assert proc.returncode == 130, err[-3000:]
    assert took < 10
    assert len(_rows(tmp_path)) == 1, "step 0 only: the interrupted step and none after it"
    assert "stopped by Ctrl-C after 1 complete step(s)" in err and "continue with --resume" in err
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step_000001"], "step 0's checkpoint is complete"
    assert "Traceback" not in err


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    proc = _start(tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert "second Ctrl-C: exiting now" in err or "stopped by Ctrl-C" in err
