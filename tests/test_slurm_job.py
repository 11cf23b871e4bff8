"""launch/slurm/train_grpo.sbatch under a real single-node Slurm (Debian's slurm-wlm with munge, started by
tests/slurm_single_node.sh as root): the tiny task at TP2 with 2 Slurm tasks; then a job requeued mid-run (as a
preemption would) continues from its newest checkpoint. Marked slurm; runs when MGRPO_SLURM_TESTS=1 (it installs
Slurm where it is missing; about 2 minutes)."""

import json
import os
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        os.environ.get("MGRPO_SLURM_TESTS") != "1", reason="set MGRPO_SLURM_TESTS=1 (root, apt) to run Slurm"
    ),
]


@pytest.fixture(scope="module")
def slurm():
    subprocess.run(["bash", os.path.join(ROOT, "tests", "slurm_single_node.sh"), "start"], check=True, timeout=600)
    yield
    subprocess.run(["bash", os.path.join(ROOT, "tests", "slurm_single_node.sh"), "stop"], timeout=60)


def submit(tmp, extra: str, launcher: str = "srun") -> str:
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHON=sys.executable,
        CONFIG="examples/tiny_cpu.yaml",
        GPUS_PER_NODE="2",
        LAUNCHER=launcher,
        LOG_DIR=str(tmp / "logs"),
        MASTER_PORT=str(29600 + os.getpid() % 300),
        EXTRA_ARGS=f"--tp 2 --model.path {tmp}/model --model.tiny --logging.output_dir {tmp}/out "
        f"--logging.report false --logging.progress_bar false {extra}",
    )
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes",
            "1",
            "--ntasks-per-node",
            "2",
            "--output",
            str(tmp / "job-%j.out"),
            os.path.join(ROOT, "launch", "slurm", "train_grpo.sbatch"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def wait_gone(job: str, timeout: float = 300, until=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if until is not None and until():
            return
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            return
        time.sleep(1)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} still queued or running after {timeout} s")


def steps(tmp) -> list:
    path = tmp / "out" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in open(path)] if path.exists() else []


def test_the_batch_script_trains_the_tiny_task_at_tp2_with_2_tasks(slurm, tmp_path):
    job = submit(tmp_path, "--train.steps 3")
    wait_gone(job)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert "training exited with status 0" in out, out
    log = (tmp_path / "logs" / f"train-{os.uname().nodename}.log").read_text()  # a log per node
    assert "reward/mean first3=" in log, log[-2000:]
    assert steps(tmp_path) == [0, 1, 2]


def test_a_requeued_job_continues_from_its_newest_checkpoint(slurm, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = submit(
        tmp_path, f"--train.steps 8 --checkpoint.save_dir {ckpt} --checkpoint.save_interval 2", launcher="torchrun"
    )
    wait_gone(job, until=lambda: (ckpt / "latest").exists() and len(steps(tmp_path)) >= 3)
    subprocess.run(["scontrol", "requeue", job], check=True)  # what a preemption does to a --requeue job
    time.sleep(2)
    wait_gone(job, timeout=400)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert "restart 1:" in out and out.rstrip().endswith("training exited with status 0"), out
    log = (tmp_path / "logs" / f"train-{os.uname().nodename}.log").read_text()
    assert "resum" in log.lower(), log[-3000:]
    assert steps(tmp_path)[-1] == 7  # metrics.jsonl was cut back to the checkpoint, then continued to the end
