"""scripts/gpu_check.sh: on a CPU machine it exits 0 with its skip summary and `--require-cuda` exits 3 with one
line; a dry rehearsal of the lent GPU machine runs every check's code at tiny shapes with megatron-core taken from
the wheel `scripts/gpu_deps.sh` makes (unpacked as gpu_check.sh does) and with what that machine lacks (datasets, vllm, matplotlib, tensorboard,
math_verify, peft) blocked from import; the bf16 judgement and the child-process reporting each have a negative
control; on a CUDA machine the real script runs (marked gpu)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ENV = {
    k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
}
CHECK_ORDER = ["cuda_ipc", "fused", "parity", "grpo_step", "fast_paths", "sync_7b"]
ABSENT_ON_GPU_MACHINE = ("datasets", "vllm", "matplotlib", "tensorboard", "math_verify", "peft")
# The packages are made absent, not broken: the path finder does not find them, so `import x` fails as on a machine
# without x and importlib.util.find_spec("x") is None (accelerate's and transformers' availability checks ask it).
BLOCKER = f"""
import importlib.machinery
BLOCKED = {ABSENT_ON_GPU_MACHINE!r}
_find = importlib.machinery.PathFinder.find_spec.__func__
def _absent(cls, name, path=None, target=None):
    return None if name.split(".")[0] in BLOCKED else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_absent)
"""


def run(cmd, timeout=300, env=None):
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its checks")
def test_without_cuda_the_script_prints_its_plan_and_exits_0():
    proc = run(["bash", "scripts/gpu_check.sh"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("  skip ")] == CHECK_ORDER
    assert lines[-1] == f"result: gpu_check=skipped checks=0/{len(CHECK_ORDER)}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_require_cuda_without_cuda_is_one_line_and_nonzero():
    proc = run(["bash", "scripts/gpu_check.sh", "--require-cuda"], timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert lines[-1].startswith("error: --require-cuda: torch ") and "sees no CUDA device" in lines[-1], lines
    assert not any(line.startswith(("check ", "result:")) for line in lines)


def test_dry_rehearsal_of_the_gpu_machine(tmp_path):
    """Every check at tiny shapes, as the lent machine will import things: megatron-core from the wheel
    gpu_deps.sh makes, unpacked (first on PYTHONPATH), the packages that machine lacks blocked (the training child too)."""
    deps, blocker = tmp_path / "deps", tmp_path / "blocker"
    made = run(["bash", "scripts/gpu_deps.sh", str(deps)], timeout=120)
    assert made.returncode == 0, made.stderr
    (wheel,) = deps.glob("megatron_core-0.16.1-py3-none-any.whl")
    site = deps / "site"  # what gpu_check.sh does with it there
    unpacked = run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(site)], timeout=60)
    assert unpacked.returncode == 0 and (site / "megatron" / "core" / "__init__.py").is_file(), unpacked.stderr
    assert (site / "megatron_core-0.16.1.dist-info" / "RECORD").is_file()
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(ENV, PYTHONPATH=f"{site}{os.pathsep}{blocker}", GPU_CHECK_LOG_DIR=str(tmp_path / "logs"))
    probe = run([sys.executable, "-c", "import vllm"], env=env, timeout=60)
    assert probe.returncode != 0 and "No module named 'vllm'" in probe.stderr  # the block works
    proc = run([sys.executable, "tests/gpu/gpu_checks.py", "--tiny"], env=env, timeout=400)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"megatron-core 0.16.1 from {site}" in proc.stdout.splitlines()[0]
    checks = [line for line in proc.stdout.splitlines() if line.startswith("check ")]
    assert [line.split()[1].rstrip(":") for line in checks] == CHECK_ORDER
    assert all(" PASS " in line for line in checks), checks
    assert proc.stdout.splitlines()[-1].endswith(f"checks={len(CHECK_ORDER)}/{len(CHECK_ORDER)}")
    assert (tmp_path / "logs" / "grpo_step.stderr.log").is_file()


def test_an_unknown_check_name_is_one_line_and_exit_2():
    proc = run([sys.executable, "tests/gpu/gpu_checks.py", "--only", "parity,nope"], timeout=60)
    assert proc.returncode == 2 and "unknown check(s) ['nope']" in proc.stdout


def test_bf16_judgement_passes_rounding_and_fails_a_fault():
    """bf16 rounding noise at the measured size passes; a real fault (one position's logits from another
    position, as a RoPE or shard error gives) fails KL and top-1, though its logits have the same statistics."""
    from gpu_checks import BF16_KL_MAX, BF16_MEAN_ABS_MAX, BF16_TOP1_MIN, bf16_agreement

    g = torch.Generator().manual_seed(0)
    ref32 = torch.randn(256, 4096, generator=g) * 0.6
    ref16 = ref32.bfloat16().float()
    mine = (ref32 + torch.randn(256, 4096, generator=g) * 0.01).bfloat16().float()
    ok = bf16_agreement(mine, ref16, ref32)
    assert ok["kl"] <= BF16_KL_MAX and ok["mean_abs"] <= BF16_MEAN_ABS_MAX and ok["top1"] >= BF16_TOP1_MIN, ok
    bad = bf16_agreement(mine.roll(1, dims=0), ref16, ref32)
    assert bad["kl"] > 100 * BF16_KL_MAX and bad["top1"] < 0.5, bad


def test_a_failing_child_keeps_its_stderr_and_shows_its_tail(tmp_path, monkeypatch):
    import gpu_checks

    monkeypatch.setenv("GPU_CHECK_LOG_DIR", str(tmp_path))
    code = "import sys\nfor i in range(50): print(f'line {i}', file=sys.stderr)\nsys.exit(7)"
    with pytest.raises(RuntimeError) as exc:
        gpu_checks.run_child("demo", [sys.executable, "-c", code])
    msg = str(exc.value)
    assert "exited 7" in msg and "line 49" in msg and "line 20" in msg and "line 19" not in msg  # the last 30
    assert (tmp_path / "demo.stderr.log").read_text().count("line ") == 50  # the whole stderr


@pytest.mark.gpu
def test_the_gpu_checks_pass_on_a_gpu():
    proc = run(["bash", "scripts/gpu_check.sh", "--require-cuda"], timeout=420)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
