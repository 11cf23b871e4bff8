"""scripts/gpu_check.sh: on a CPU machine it exits 0 with its skip summary; the checks' own code runs here at tiny
shapes (so the GPU script is not dead code on CPU); on a CUDA machine the real script runs (marked gpu)."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def run(cmd, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its checks")
def test_without_cuda_the_script_prints_its_plan_and_exits_0():
    proc = run(["bash", "scripts/gpu_check.sh"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("  skip ")] == \
        ["parity", "grpo_step", "fused", "sync_7b", "cuda_ipc"]
    assert lines[-1] == "result: gpu_check=skipped checks=0/5"


def test_the_checks_run_at_tiny_shapes_on_this_machine():
    """parity (fp32 1e-4, bf16 top-1), fused vs naive, export + in-process sync; grpo_step is a plain tiny run
    and is left to tests/test_trainer.py here (it costs a launch)."""
    proc = run([sys.executable, "tests/gpu/gpu_checks.py", "--tiny", "--only", "parity,fused,sync_7b,cuda_ipc"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if line.startswith("check ")]
    assert len(checks) == 4 and all(" PASS " in line for line in checks), checks
    assert proc.stdout.splitlines()[-1].endswith("checks=4/4")


def test_an_unknown_check_name_is_one_line_and_exit_2():
    proc = run([sys.executable, "tests/gpu/gpu_checks.py", "--only", "parity,nope"], timeout=60)
    assert proc.returncode == 2 and "unknown check(s) ['nope']" in proc.stdout


@pytest.mark.gpu
def test_the_gpu_checks_pass_on_a_gpu():
    proc = run(["bash", "scripts/gpu_check.sh"], timeout=420)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
