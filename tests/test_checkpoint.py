"""Whole-state checkpoints and exact resume, through the launcher: a 6-step run saved at step 3 and resumed equals
the uninterrupted run bitwise (samples, losses, final weights) at TP1, TP2 x PP2 and DP2 with the distributed
optimizer (async save); SIGKILL mid-step and mid-save; a layout change on resume; refusals of bad input.

CPU fp32, steps_per_generation 2 and a cosine LR schedule with warmup in every run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "launch", "train_grpo.py")
STEPS = 6
COMMON = [
    "--config",
    os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
    "--train.steps",
    str(STEPS),
    "--model.tiny.num_layers",
    "2",
    "--model.tiny.hidden_size",
    "64",
    "--rollout.n",
    "4",
    "--rollout.prompts_per_step",
    "4",
    "--rollout.max_tokens",
    "16",
    "--train.micro_batch_size",
    "4",
    "--train.steps_per_generation",
    "2",
    "--train.lr_schedule",
    "cosine",
    "--train.warmup_steps",
    "3",
    "--logging.progress_bar",
    "false",
    "--logging.completions_interval",
    "1",
    "--logging.completions_token_ids",
    "true",
    "--logging.report",
    "false",
    "--logging.tensorboard",
    "true",
    "--checkpoint.save_interval",
    "3",
    "--checkpoint.export_hf_at_end",
    "true",
]
UNTIMED = ("timing/", "perf/")


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MGRPO_TEST_PAUSE")
    }
    return {**env, **extra}


def launch(
    root,
    name: str,
    *extra,
    nproc: int = 1,
    pause: str | None = None,
    output: str | None = None,
    expect_rc: int = 0,
    launcher: str = LAUNCHER,
    torchrun: tuple = (),
    env: dict | None = None,
    watch=None,
):
    """One run of the launcher (torchrun when nproc > 1) into root/name (output dir) and root/name-ckpt.
    With `pause` ("train:4" or "save:6") the run is SIGKILLed, whole process group, once the hook holds it there."""
    from mgrpo.parallel.distributed import free_port

    out = output or str(root / name)
    prefix = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            *torchrun,
        ]
    )
    cmd = prefix + [
        launcher,
        *COMMON,
        "--model.path",
        str(root / "model"),
        "--model.tiny",
        "--logging.output_dir",
        out,
        "--checkpoint.save_dir",
        str(root / f"{name}-ckpt"),
        *extra,
    ]
    marker = str(root / f"{name}.paused")
    if os.path.exists(marker):
        os.remove(marker)
    env = _env(MGRPO_TEST_PAUSE=pause, MGRPO_TEST_PAUSE_MARKER=marker, **(env or {})) if pause else _env(**(env or {}))
    if watch is not None:  # watch() is called until it returns True, then the run goes on to its end
        with open(root / f"{name}.out", "w") as out_f, open(root / f"{name}.err", "w") as err_f:
            proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, cwd=ROOT, env=env)
            deadline = time.time() + 600
            while proc.poll() is None and not watch() and time.time() < deadline:
                time.sleep(0.2)
            proc.wait(timeout=max(1, deadline - time.time()))
        r = subprocess.CompletedProcess(cmd, proc.returncode, open(out_f.name).read(), open(err_f.name).read())
        assert r.returncode == expect_rc, r.stderr[-4000:]
        return r
    if pause is None:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert r.returncode == expect_rc, r.stderr[-4000:]
        return r
    log = open(root / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.time() + 300
    while not os.path.exists(marker):
        assert proc.poll() is None, open(root / f"{name}.log").read()[-4000:]
        assert time.time() < deadline, "the run never reached " + pause
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    return open(root / f"{name}.log").read()


def rows(path) -> list:
    return [json.loads(line) for line in open(path)]


def weights(ckpt_dir) -> bytes:
    return open(os.path.join(ckpt_dir, f"hf_step_{STEPS:06d}", "model-00001-of-00001.safetensors"), "rb").read()


def assert_same_run(ref, other, ref_ckpt, other_ckpt):
    """Every step once, equal samples (token ids), losses and every untimed metric; equal final weights, bitwise."""
    a, b = rows(os.path.join(ref, "metrics.jsonl")), rows(os.path.join(other, "metrics.jsonl"))
    assert [r["step"] for r in b] == list(range(STEPS)), "each step appears exactly once"
    for x, y in zip(a, b):
        diff = {k: (x[k], y.get(k)) for k in x if not k.startswith(UNTIMED) and x[k] != y.get(k)}
        assert not diff, f"step {x['step']}: {diff}"
    assert rows(os.path.join(ref, "completions.jsonl")) == rows(os.path.join(other, "completions.jsonl"))
    assert weights(ref_ckpt) == weights(other_ckpt), "the final weights differ"


def resume_copy(root, ref: str, name: str, ckpt: str, *extra, nproc: int = 1, launcher: str = LAUNCHER):
    """Resume `ckpt` into a copy of the reference's output folder (its metrics are cut back, then appended)."""
    shutil.copytree(root / ref, root / name)
    return launch(root, name, "--resume", ckpt, *extra, nproc=nproc, launcher=launcher)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    launch(root, "tp1")
    return root


def test_resume_at_tp1_equals_the_uninterrupted_run(runs):
    r = resume_copy(runs, "tp1", "tp1_resumed", str(runs / "tp1-ckpt" / "step_000003"))
    assert "resuming from" in r.stdout and "(step 3, weight version 3)" in r.stdout
    assert_same_run(runs / "tp1", runs / "tp1_resumed", runs / "tp1-ckpt", runs / "tp1_resumed-ckpt")
    meta = json.load(open(runs / "tp1-ckpt" / "step_000003" / "mgrpo_meta.json"))
    assert meta["state"]["prompts"]["pos"] == 12 and meta["state"]["actor"]["scheduler"]["num_steps"] == 6
    size = sum(meta["files"].values())
    print(
        f"tiny checkpoint (2 layers, hidden 64, + Adam state): {size / 2**20:.2f} MiB, saved in "
        f"{meta['save_seconds']:.2f} s"
    )


def test_kill_mid_step_then_mid_save_resumes_from_the_last_complete_checkpoint(runs):
    """Killed between an update and its sync (step 4), resumed from `latest` (step 3); that run killed while its
    step-6 shards sit in step_000006.tmp; resumed again: the same run as the uninterrupted one. keep_last 1 prunes
    step 3 only once step 6 is complete, and TensorBoard shows every step once."""
    ckpt, keep = runs / "kill-ckpt", ["--checkpoint.keep_last", "1"]
    launch(runs, "kill", *keep, pause="train:4")
    assert open(ckpt / "latest").read().strip() == "step_000003" and not (ckpt / "step_000006").exists()
    assert [r["step"] for r in rows(runs / "kill" / "metrics.jsonl")] == [0, 1, 2, 3]
    log = launch(runs, "kill", "--resume", *keep, pause="save:6")
    assert "resuming from" in log and "step_000003 (step 3" in log
    assert (ckpt / "step_000006.tmp" / "dist").is_dir() and not (ckpt / "step_000006").exists()
    assert open(ckpt / "latest").read().strip() == "step_000003", "latest never points at an incomplete save"
    assert (ckpt / "step_000003").is_dir(), "pruning waits for the new checkpoint"
    r = launch(runs, "kill", "--resume", *keep)
    assert "step_000003 (step 3" in r.stdout and ".tmp" not in r.stdout
    assert sorted(os.listdir(ckpt)) == ["hf_step_000006", "latest", "step_000006"]
    assert_same_run(runs / "tp1", runs / "kill", runs / "tp1-ckpt", ckpt)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "kill" / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("actor/loss")
    assert [s.step for s in scalars] == list(range(STEPS))
    assert [s.value for s in scalars] == pytest.approx([m["actor/loss"] for m in rows(runs / "tp1" / "metrics.jsonl")])


def test_tp2_pp2_resumes_exactly_and_at_tp1(runs):
    """With the distributed optimizer saved layout-free (checkpoint.reshardable: megatron's fully_reshardable)."""
    opt = ["--train.use_distributed_optimizer", "true", "--checkpoint.reshardable", "true"]
    launch(runs, "tp2pp2", "--tp", "2", "--pp", "2", *opt, nproc=4)
    resume_copy(
        runs,
        "tp2pp2",
        "tp2pp2_resumed",
        str(runs / "tp2pp2-ckpt" / "step_000003"),
        "--tp",
        "2",
        "--pp",
        "2",
        *opt,
        nproc=4,
    )
    assert_same_run(runs / "tp2pp2", runs / "tp2pp2_resumed", runs / "tp2pp2-ckpt", runs / "tp2pp2_resumed-ckpt")
    # a layout change: the TP2 x PP2 checkpoint continued at TP1 (dist_checkpointing reshards model and Adam state)
    r = launch(runs, "tp1_from_tp2pp2", "--resume", str(runs / "tp2pp2-ckpt" / "step_000003"), *opt)
    assert "the layout changed (TP2 PP2" in r.stderr
    ref = rows(runs / "tp2pp2" / "metrics.jsonl")[3]
    got = rows(runs / "tp1_from_tp2pp2" / "metrics.jsonl")
    assert [g["step"] for g in got] == [3, 4, 5]
    print(f"first resumed step: loss TP1 {got[0]['actor/loss']:.9f} vs TP2xPP2 {ref['actor/loss']:.9f}")
    assert abs(got[0]["actor/loss"] - ref["actor/loss"]) < 1e-5
    assert got[0]["reward/mean"] == ref["reward/mean"], "the same samples: the engine got the same weights"


def test_dp2_distributed_optimizer_with_async_save_resumes_exactly(runs):
    """The default format (each rank writes its own optimizer shard, megatron's dp_reshardable), with megatron-core
    on its TransformerEngine optimizer branch (tests/te_adam_run.py: its module flags, and an optimizer that lays
    out its state as TE's FusedAdam does: the step in the param groups, no per-parameter `step`): exact at DP2,
    continued at DP1; a TP change is refused in one line before anything starts. Allocating a per-parameter `step`
    before the load (what checkpoint.py did) fails the resume with KeyError: 'step' (measured once: raised by the
    state-key table TE's FusedAdam keeps; megatron's `_set_main_param_and_optimizer_states` would raise the same).
    torch's Adam with the distributed optimizer resumes in test_tp2_pp2_resumes_exactly_and_at_tp1.

    The resumed run is a hang and a restart (issue 54): under torchrun --max-restarts 1 with --resume auto, rank 1
    stops (SIGSTOP) in step 5; rank 0's step watchdog (train.step_timeout_s 8) writes its stacks, prints one line
    naming rank 1 and exits 3; torchrun ends rank 1 and restarts both; the second attempt resumes from the step-3
    checkpoint (written synchronously; the async-written one loads at DP1 below) and equals the uninterrupted run
    bitwise. Data lost: steps 3-4, trained again."""
    te = os.path.join(ROOT, "tests", "te_adam_run.py")
    dp = ["--train.use_distributed_optimizer", "true", "--checkpoint.async_save", "true"]
    r = launch(runs, "dp2", *dp, nproc=2, launcher=te)
    assert "TELayoutAdam steps: 12" in r.stderr  # 6 steps x 2 mini-batches, all through the TE-layout optimizer
    ckpt = str(runs / "dp2-ckpt" / "step_000003")
    meta = json.load(open(os.path.join(ckpt, "mgrpo_meta.json")))
    assert meta["layout"]["optimizer_format"] == "dp_reshardable" and len(meta["save_peak_host_mib"]) == 2
    limit, started = 8, time.monotonic()
    summary = runs / "dp2_restarted" / "hang" / "summary.txt"

    def kill_the_stopped_rank() -> bool:
        """A stopped process ignores torchrun's SIGTERM until its 30 s grace ends: end it as a node failure would."""
        if not summary.is_file() or " pid " not in summary.read_text():
            return False
        os.kill(int(summary.read_text().split(" pid ")[1].split(")")[0]), signal.SIGKILL)
        return True

    r = launch(
        runs,
        "dp2_restarted",
        *dp[:2],  # saved synchronously: an async save of step 3 may not be final when rank 1 stops in step 5
        "--resume",
        "auto",
        "--train.step_timeout_s",
        str(limit),
        nproc=2,
        launcher=te,
        torchrun=("--max-restarts=1",),
        env=dict(MGRPO_TEST_STOP="train:5:1"),
        watch=kill_the_stopped_rank,
    )
    hang = [line for line in r.stderr.splitlines() if "hang: step 5 ran past" in line]
    print(f"\n{hang[0] if hang else r.stderr[-3000:]}\nwhole torchrun: {time.monotonic() - started:.1f} s")
    assert len(hang) == 1 and "rank 1 (" in hang[0] and "silent for" in hang[0] and "last in 'train'" in hang[0]
    elapsed = float(hang[0].split(f"train.step_timeout_s={limit} s (")[1].split(" s)")[0])
    assert limit <= elapsed <= limit + 3 * limit / 6 + 2, elapsed
    assert (runs / "dp2_restarted" / "hang" / "rank_0.txt").is_file()
    assert "mgrpo: --resume auto: no checkpoint" in r.stdout  # the first attempt
    assert "resuming from" in r.stdout and "step_000003 (step 3" in r.stdout  # the second
    assert "TELayoutAdam steps: 6" in r.stderr  # the second attempt's 3 steps
    assert_same_run(runs / "dp2", runs / "dp2_restarted", runs / "dp2-ckpt", runs / "dp2_restarted-ckpt")
    launch(runs, "dp1_from_dp2", "--resume", ckpt, *dp, launcher=te)
    ref, got = rows(runs / "dp2" / "metrics.jsonl")[3], rows(runs / "dp1_from_dp2" / "metrics.jsonl")
    assert [g["step"] for g in got] == [3, 4, 5] and abs(got[0]["actor/loss"] - ref["actor/loss"]) < 1e-5
    from mgrpo.config import load_config
    from mgrpo.resume import ResumeError, check_resume

    argv = [*COMMON, "--model.path", str(runs / "model"), "--model.tiny", *dp, "--checkpoint.resume", ckpt]
    argv += ["--checkpoint.save_dir", str(runs / "dp2_tp2-ckpt"), "--logging.output_dir", str(runs / "dp2_tp2")]
    with pytest.raises(ResumeError) as refused:
        check_resume(load_config(argv=[*argv, "--parallel.tp", "2"], check_files=False))
    line = refused.value.lines
    assert len(line) == 1 and "saved per data-parallel shard" in line[0] and "TP 1 -> 2" in line[0], line


def _main(argv, capsys):
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import train_grpo

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    rc = train_grpo.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_bad_resume_input_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, capsys, tiny_dirs):
    base = [
        *COMMON,
        "--model.path",
        str(runs / "model"),
        "--logging.output_dir",
        str(tmp_path / "out"),
        "--checkpoint.save_dir",
        str(tmp_path / "ckpt"),
    ]
    os.makedirs(tmp_path / "ckpt")
    other = tiny_dirs("resume_other", family="qwen2", vocab_size=300, hidden_size=128, num_layers=2, seed=0)
    capsys.readouterr()
    rc, err = _main(base + ["--resume"], capsys)  # nothing saved yet
    assert rc == 2 and len(err) == 1 and "no checkpoint in checkpoint.save_dir" in err[0], err
    bad = tmp_path / "ckpt" / "step_000003"
    shutil.copytree(runs / "tp1-ckpt" / "step_000003", bad)
    shard = bad / "dist" / "__0_0.distcp"
    os.truncate(shard, os.path.getsize(shard) // 2)
    rc, err = _main(base + ["--resume", str(bad)], capsys)
    assert rc == 2 and len(err) == 1 and "__0_0.distcp" in err[0] and "truncated" in err[0], err
    rc, err = _main(
        base + ["--model.path", other, "--model.tiny", "null", "--resume", str(runs / "tp1-ckpt" / "step_000003")],
        capsys,
    )
    assert rc == 2 and len(err) == 1 and "another model: hidden_size is 64 in the checkpoint" in err[0], err
    rc, err = _main(
        base + ["--rollout.n", "8", "--train.seed", "7", "--resume", str(runs / "tp1-ckpt" / "step_000003")], capsys
    )
    assert rc == 2 and len(err) == 2 and "rollout.n=8" in err[0] and "train.seed=7" in err[1], err
    rc, err = _main(base + ["--train.steps", "3", "--resume", str(runs / "tp1-ckpt" / "step_000003")], capsys)
    assert rc == 2 and len(err) == 1 and "nothing to train; raise train.steps above 3" in err[0], err
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path / "ckpt") == ["step_000003"]
