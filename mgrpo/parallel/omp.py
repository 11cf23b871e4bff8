"""OpenMP's wait policy, chosen so a CPU run is never pathological. Import before torch: libgomp reads the
environment once.

After each parallel region libgomp's threads spin-wait (about 300k iterations) before they sleep. That costs
whenever something else wants the cores: other ranks of the job (torchrun ranks x OMP_NUM_THREADS > cores), its
engines, or any process outside the run. Measured on this project's 2-core machines, the README's main job
(examples/tiny_cpu.yaml, 30 steps, wall clock from the shell):

    policy                      quiet      one busy process on the other core
    default (spin, then sleep)  23.6 s     69.2 s
    GOMP_SPINCOUNT=10000        25.2 s     87.0 s
    PASSIVE                     30.5 s     31.2 s

(and DP2 with one vLLM engine per DP group, 8 steps: 47.8 s default, 12.7 s PASSIVE). PASSIVE costs ~30% on a quiet
machine and saves 2-4x under load, so on a machine without NVIDIA GPUs it is the default; on a GPU node the
trainer's CPU threads matter little, and the default stays unless the node is oversubscribed. A value the user set
(OMP_WAIT_POLICY=ACTIVE for a quiet benchmark) always wins.
"""

from __future__ import annotations

import glob
import os


def local_ranks() -> int:
    """Processes of this job on this node: torchrun's LOCAL_WORLD_SIZE or Slurm's tasks per node (e.g. '4(x2)')."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "1"
    try:
        return max(1, int(value.split("(")[0].split(",")[0]))
    except ValueError:
        return 1


def _oversubscribed() -> bool:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS") or cores)
    except ValueError:
        threads = cores
    return local_ranks() * threads > cores


def has_nvidia_gpu() -> bool:
    """An NVIDIA device node, checked without importing torch (which must come after the policy is set)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def choose_wait_policy() -> str | None:
    """Set OMP_WAIT_POLICY=PASSIVE on CPU machines and on oversubscribed nodes, unless the user set a policy;
    returns the policy now in force (None: libgomp's default)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"]
    if has_nvidia_gpu() and not _oversubscribed():
        return None
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
