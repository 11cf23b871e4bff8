"""OpenMP's wait policy for CPU ranks that share cores. Import before torch: libgomp reads the environment once.

With more OpenMP threads on a node than cores (torchrun ranks x OMP_NUM_THREADS, e.g. the CPU tests' DP2 or
TP2 x PP2 on 2 cores), threads that spin-wait after each parallel region steal the cores the other ranks and the
engines need. Measured on 2 cores, DP2 with one vLLM engine per DP group, 8 steps once `datasets` (pyarrow) is
imported: 47.8 s of steps with the default policy, 12.7 s with PASSIVE. Without oversubscription PASSIVE costs
(the single-process main job: 22.1 s -> 38.9 s), so it is set only when the threads outnumber the cores, and never
over a value the user chose.
"""
from __future__ import annotations

import os


def local_ranks() -> int:
    """Processes of this job on this node: torchrun's LOCAL_WORLD_SIZE or Slurm's tasks per node (e.g. '4(x2)')."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "1"
    try:
        return max(1, int(value.split("(")[0].split(",")[0]))
    except ValueError:
        return 1


def passive_wait_if_oversubscribed() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE when ranks x OMP_NUM_THREADS exceed this process's cores; True if set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS") or cores)
    except ValueError:
        threads = cores
    if "OMP_WAIT_POLICY" in os.environ or local_ranks() * threads <= cores:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
