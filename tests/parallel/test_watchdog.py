"""The step watchdog (mgrpo/parallel/watchdog.py) on real processes: two gloo ranks, rank 1 SIGSTOPped in a step
while rank 0 waits for it in an all-reduce; rank 0's watchdog writes its stacks (the all-reduce in them), prints one
line naming rank 1 (host, pid, last phase) within the deadline + 3 heartbeats, and exits 3. Negative control: the
same run with a limit longer than the step finishes with exit 0 and no report. The trainer's wiring (a rank stopped
mid-step under torchrun --max-restarts, then --resume auto) runs in tests/test_checkpoint.py's DP2 test."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mgrpo.parallel.watchdog import StepWatchdog, nccl_diagnostics_env

WORKER = r"""
import os, signal, sys, time
import torch, torch.distributed as dist
from mgrpo.parallel.watchdog import StepWatchdog, heartbeat_store, where

rank, out, limit, fault = int(os.environ["RANK"]), sys.argv[1], float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2)
dog = StepWatchdog(out, rank, 2, timeout_s=limit, heartbeat_s=0.5, store=heartbeat_store())
for step in range(2):
    with dog.step(step):
        where("train")
        time.sleep(0.8)  # heartbeats of this phase reach the store
        if step == 1 and rank == 1 and fault != "none":
            print(f"stopping {os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        where("sync")
        t = torch.ones(1)
        try:
            dist.all_reduce(t)
        except RuntimeError:  # what the trainer does (trainer.fit)
            print(f"error: rank {rank}: {dog.gone_peers()}", file=sys.stderr, flush=True)
            raise SystemExit(1)
dog.close()
print(f"rank {rank} done {float(t)}", flush=True)
dist.barrier()  # as the trainer ends (shutdown_distributed): rank 0's store outlives rank 1's use of it
dist.destroy_process_group()
"""


def _launch(tmp_path, limit: float, fault: str):
    from mgrpo.parallel.distributed import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path / "out"), str(limit), fault],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    return procs


def test_a_stopped_rank_is_named_within_the_deadline(tmp_path):
    limit = 3.0
    procs = _launch(tmp_path, limit, "stop")
    started = time.monotonic()
    try:
        out0, err0 = procs[0].communicate(timeout=120)
        seconds = time.monotonic() - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    stopped_pid = int(procs[1].stdout.read().split("stopping ")[1].split()[0])
    lines = [line for line in err0.splitlines() if line.startswith("hang:")]
    print("\n" + "\n".join(lines) + f"\nrank 0 exited {procs[0].returncode} after {seconds:.1f} s (start-up included)")
    assert procs[0].returncode == 3 and len(lines) == 1, err0[-3000:]
    line = lines[0]
    assert f"hang: step 1 ran past train.step_timeout_s={limit:g} s" in line
    assert "rank 1 (" in line and f"pid {stopped_pid}) silent for" in line and "last in 'train'" in line
    assert "answering: 0:sync" in line and str(tmp_path / "out" / "hang") in line
    elapsed = float(line.split(f"train.step_timeout_s={limit:g} s (")[1].split(" s)")[0])
    assert limit <= elapsed <= limit + 3 * 0.5 + 1, elapsed  # the step's own clock: deadline + 3 heartbeats
    stacks = (tmp_path / "out" / "hang" / "rank_0.txt").read_text()
    assert "phase 'sync'" in stacks and "all_reduce" in stacks, stacks[:2000]
    assert (tmp_path / "out" / "hang" / "summary.txt").read_text().strip() == line
    assert not (tmp_path / "out" / "hang" / "rank_1.txt").exists()  # a stopped rank writes nothing: the line says so


def test_a_killed_rank_is_named_at_once(tmp_path):
    """SIGKILL: the survivor's all-reduce raises (gloo sees the connection close) and the line names the rank
    whose process is gone (its heartbeat's pid on this host), long before any step deadline."""
    procs = _launch(tmp_path, 120.0, "kill")
    started = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    seconds = time.monotonic() - started
    procs[1].wait(timeout=30)
    killed_pid = int(procs[1].stdout.read().split("stopping ")[1].split()[0])
    lines = [line for line in err0.splitlines() if line.startswith("error: rank 0:")]
    print(f"\n{lines}\nrank 0 exited {procs[0].returncode} after {seconds:.1f} s (start-up included)")
    assert procs[0].returncode == 1 and len(lines) == 1, err0[-3000:]
    assert (
        f"collective failed in step 1, phase 'sync': process gone: rank 1 (pid {killed_pid}, last in 'train')"
        in lines[0]
    )
    assert seconds < 30 and not (tmp_path / "out" / "hang").exists()


def test_negative_control_a_step_within_its_limit_is_not_reported(tmp_path):
    procs = _launch(tmp_path, 120.0, "none")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "done 2.0" in outs[0][0] and not (tmp_path / "out" / "hang").exists()


def test_the_automatic_limit_follows_the_slowest_step():
    dog = StepWatchdog("/nonexistent", 0, 1, timeout_s=0)  # 0: no thread; the limit still computes
    dog.timeout_s = None
    assert dog.limit() == 1800.0  # before any step has finished
    dog.slowest = 12.0
    assert dog.limit() == 300.0
    dog.slowest = 45.0
    assert dog.limit() == 450.0
    assert StepWatchdog("/nonexistent", 0, 1, timeout_s=0)._thread is None


def test_nccl_diagnostics_keep_what_the_user_set():
    env = nccl_diagnostics_env("/out/hang", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # the user's choice stands
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == "/out/hang/nccl_trace_rank_"


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_step_timeout_is_one_line(value):
    from mgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(argv=["--model.path", "m", "--data.path", "d", "--train.step_timeout_s", value], check_files=False)
    assert len(err.value.errors) == 1 and "train.step_timeout_s" in err.value.errors[0]
