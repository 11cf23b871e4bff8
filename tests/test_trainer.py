"""The walking skeleton: a short GRPO run learns on CPU, a flipped advantage does not, and weight sync
leaves the HF engine computing the trainer's own logprobs."""

import os

import pytest
import torch

from mgrpo.config import load_config
from mgrpo.data.microbatch import make_microbatches
from mgrpo.loss.registry import advantages, register_advantage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


@register_advantage("grpo_flipped")
def _flipped(rewards, group_ids, cfg):
    """Negative control: pushes the policy away from reward."""
    return -advantages("grpo")(rewards, group_ids, cfg)


def make_trainer(tmp_path, tiny_dirs, *extra):
    from mgrpo.trainer import GRPOTrainer

    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
            "--logging.output_dir",
            str(tmp_path / "run"),
            "--logging.progress_bar",
            "false",
            "--train.steps",
            str(STEPS),
            *extra,
        ],
    )
    cfg.model.tiny = None
    return GRPOTrainer(cfg)


def _rise(history, k=3):
    first = sum(h["reward/mean"] for h in history[:k]) / k
    last = sum(h["reward/mean"] for h in history[-k:]) / k
    return first, last


def test_engine_logprobs_equal_trainer_after_sync(single_rank, tmp_path, tiny_dirs):
    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "2")
    for step in range(2):
        trainer.step(step)
        sample = trainer.rollout_and_score(100 + step)[0]
        mb = make_microbatches([sample], 1, trainer.tokenizer.pad_token_id)[0]
        ours = trainer.actor.logprobs([mb])[0][mb["loss_mask"].bool()]
        theirs = trainer.engine.score(sample.prompt_ids, sample.response_ids, trainer.cfg.rollout.temperature)
        assert trainer.engine.version == step + 1
        diff = (ours - theirs).abs().max().item()
        print(f"step {step}: max |engine - trainer| logprob = {diff:.2e}")
        assert diff <= 1e-4
        # the rollout's own logprobs (sampled under the synced weights) agree too
        assert (torch.tensor(sample.rollout_logprobs) - theirs).abs().max() <= 1e-4


def test_short_run_learns_and_flipped_advantage_does_not(single_rank, tmp_path, tiny_dirs):
    up = make_trainer(tmp_path / "up", tiny_dirs).fit()
    down = make_trainer(tmp_path / "down", tiny_dirs, "--algorithm.advantage", "grpo_flipped").fit()
    f_up, l_up = _rise(up)
    f_down, l_down = _rise(down)
    print(f"reward first3->last3: grpo {f_up:.3f}->{l_up:.3f}, flipped {f_down:.3f}->{l_down:.3f}")
    assert abs(f_up - f_down) < 0.05, "both runs start from the same model and seed"
    assert l_up >= f_up + 0.1
    assert l_down <= l_up - 0.1
    assert os.path.isfile(tmp_path / "up" / "run" / "metrics.jsonl")


def test_torchrun_tp2_pp2_with_kl_entropy_is_and_checkpoint_converts(tmp_path):
    """The launcher under torchrun at TP2 x PP2 with every optional loss term, checkpoints, and a conversion. The
    logged KL to the reference at step 1 (k3, the loss term's estimator) equals the one HF transformers computes in
    float64 from the same samples (completions.jsonl) with the step-1 checkpoint converted to HF as the policy and
    the model folder as the reference; the k1 estimate of the same samples, and the KL of the reference to itself,
    are caught (negative controls)."""
    import json
    import subprocess
    import sys

    from mgrpo.parallel.distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--master-port={free_port()}",
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        "--tp",
        "2",
        "--pp",
        "2",
        "--train.steps",
        "2",
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--checkpoint.save_dir",
        str(tmp_path / "ckpt"),
        "--checkpoint.save_interval",
        "1",
        "--logging.output_dir",
        str(tmp_path / "run"),
        "--logging.progress_bar",
        "false",
        "--logging.completions_interval",
        "1",
        "--logging.completions_token_ids",
        "true",
        "--algorithm.kl_coef",
        "0.01",
        "--algorithm.entropy_coef",
        "0.001",
        "--algorithm.rollout_is_mode",
        "tis",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [0, 1]
    last = rows[-1]
    assert last["actor/entropy"] > 0 and last["weight_version"] == 2
    assert last["actor/skipped_steps"] == 0 and last["rollout_is/missing_logprob_samples"] == 0
    assert "algorithm (value, from):" in r.stdout and "kl_coef                0.01" in r.stdout
    # the engine sampled with the weights the trainer synced: its logprobs equal the trainer's old logprobs
    assert last["rollout_is/rollout_logp_abs_diff"] < 1e-4
    out = tmp_path / "hf"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "convert_to_hf.py"),
            "--checkpoint",
            str(tmp_path / "ckpt" / "step_000001"),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float64).eval()
    samples = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    samples = [c for c in samples if c["step"] == 1]
    assert len(samples) == 64
    temp = 1.0  # examples/tiny_cpu.yaml's rollout.temperature
    d = []  # log pi_ref - log pi over every response token of the step (all are loss tokens here)
    for c in samples:
        ids, n = torch.tensor([c["prompt_ids"] + c["response_ids"]]), len(c["prompt_ids"])
        with torch.no_grad():
            lp = [
                torch.log_softmax(m(ids).logits[0] / temp, -1)[n - 1 : -1].gather(1, ids[0, n:, None])[:, 0]
                for m in (policy, ref)
            ]
        d.append(lp[1] - lp[0])
    d = torch.cat(d)
    k3, k1 = float((torch.exp(d) - d - 1).mean()), float((-d).mean())
    got = last["actor/kl_ref"]
    print(f"TP2xPP2 step 1: actor/kl_ref {got:.6e}, HF float64 k3 {k3:.6e} (k1 {k1:.3e}, self 0)")
    assert got == pytest.approx(k3, rel=1e-3, abs=1e-7)
    assert abs(got - k1) > 1e-2 * k3 and got > 100 * 1e-7, "k1, or a KL of 0, would be caught"


def test_failed_rewards_train_nothing_and_metrics_stay_finite(single_rank, tmp_path, tiny_dirs):
    """A reward that raises for some samples: those samples fail (counted), the step trains on the rest; CISPO's
    clip fraction and the KL loss term's kl_ref are reported; no metric is NaN."""
    import math

    from mgrpo.rewards.registry import register_reward

    @register_reward("_t_flaky")
    def flaky(samples, tokenizer, **_):
        if any(len(s.response_ids) % 3 == 0 for s in samples):
            raise RuntimeError("judge timed out")
        return [0.0 for _ in samples]

    trainer = make_trainer(
        tmp_path,
        tiny_dirs,
        "--train.steps",
        "1",
        "--reward.funcs",
        "[token_fraction, _t_flaky]",
        "--algorithm.loss_type",
        "cispo",
        "--algorithm.kl_coef",
        "0.05",
    )
    m = trainer.step(0)
    n = trainer.cfg.rollout.n * trainer.cfg.rollout.prompts_per_step
    assert 0 < m["reward/failed"] < n and m["actor/skipped_steps"] == 0
    for key in (
        "actor/clip_frac",
        "actor/kl_ref",
        "reward/std",
        "reward/mean",
        "actor/loss",
        "actor/grad_norm",
        "actor/entropy",
        "timing/step",
        "perf/tokens_per_s",
    ):
        assert key in m and math.isfinite(m[key]), key
    assert trainer.cfg.algorithm.policy_loss == "cispo"


def _launch(tmp_path, name, *extra, nproc=2):
    import subprocess
    import sys

    from mgrpo.parallel.distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    out = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        os.path.join(ROOT, "launch", "train_grpo.py"),
        "--config",
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        "--train.steps",
        "2",
        "--model.path",
        str(tmp_path / "model"),
        "--model.tiny",
        "--logging.output_dir",
        str(out),
        "--logging.progress_bar",
        "false",
        "--logging.completions_interval",
        "1",
        "--logging.completions_token_ids",
        "true",
        "--logging.report",
        "false",
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    return (
        [json.loads(line) for line in open(out / "metrics.jsonl")],
        [json.loads(line) for line in open(out / "completions.jsonl")],
    )


def test_one_engine_per_dp_group_matches_one_engine(tmp_path):
    """DP2 under torchrun: with one engine per DP group the 64 requests of a step are spread 32/32, both engines
    serve the same weight version after each update, and the samples equal the single-engine run's."""
    one_metrics, one = _launch(tmp_path, "rank0", "--rollout.engine_placement", "rank0")
    two_metrics, two = _launch(tmp_path, "per_dp", "--rollout.engine_placement", "per_dp")
    assert [m["rollout/requests/hf#0"] for m in one_metrics] == [64, 64]
    assert [(m["rollout/requests/hf#0"], m["rollout/requests/hf#1"]) for m in two_metrics] == [(32, 32), (32, 32)]
    for step in (0, 1):
        rows = [r for r in two if r["step"] == step]
        assert {r["weight_version"] for r in rows} == {step}, "both engines sampled with the same version"
    key = lambda r: (r["step"], r["group"])  # noqa: E731
    assert [(key(r), r["response_ids"]) for r in sorted(one, key=key)] == [
        (key(r), r["response_ids"]) for r in sorted(two, key=key)
    ]
    assert one_metrics[-1]["reward/mean"] == pytest.approx(two_metrics[-1]["reward/mean"])


def test_clipping_is_live_with_mini_batches(single_rank, tmp_path, tiny_dirs):
    """steps_per_generation 4: the first mini-batch trains on the rollout policy itself (ratio exactly 1, kl_old 0),
    every later one sees ratios the earlier updates moved (clip_frac > 0, kl_old > 0)."""
    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "1", "--train.steps_per_generation", "4")
    trainer.step(0)
    first, *later = trainer.update_metrics
    assert len(later) == 3
    assert first["actor/ratio_mean"] == 1.0 and first["actor/kl_old"] == 0.0 and first["actor/clip_frac"] == 0.0
    for u in later:
        assert u["actor/clip_frac"] > 0 and u["actor/kl_old"] > 0, u


def _schedule(k: int, lr: float, min_lr: float, warm: int, total: int) -> float:
    """The LR of optimizer step k (1-based): lr k / warm in the warmup, then cosine to min_lr at step `total`."""
    import math

    if k <= warm:
        return lr * k / warm
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm)))


SCHEDULE = dict(lr=0.003, min_lr=0.0003, warm=2, total=6)  # 3 rollout steps x 2 mini-batches


def _schedule_trainer(tmp_path, tiny_dirs, *extra):
    s = SCHEDULE
    return make_trainer(
        tmp_path,
        tiny_dirs,
        "--train.steps",
        "3",
        "--train.steps_per_generation",
        "2",
        "--train.lr_schedule",
        "cosine",
        "--train.warmup_steps",
        str(s["warm"]),
        "--train.min_lr",
        str(s["min_lr"]),
        "--train.lr",
        str(s["lr"]),
        *extra,
    )


def test_cosine_schedule_with_warmup_follows_the_formula(single_rank, tmp_path, tiny_dirs):
    """6 optimizer steps: warmup over 2 (lr/2, then lr: the first step does not train at LR 0, as Megatron-LM's
    loop would), then cosine to min_lr at the last step; actor/lr is the LR each update used."""
    trainer = _schedule_trainer(tmp_path, tiny_dirs)
    seen = []
    for step in range(3):
        m = trainer.step(step)
        seen += [u["actor/lr"] for u in trainer.update_metrics]
        assert m["actor/lr"] == seen[-1]
    assert seen == pytest.approx([_schedule(k, **SCHEDULE) for k in range(1, 7)], rel=1e-12, abs=1e-15)
    assert seen[0] == pytest.approx(SCHEDULE["lr"] / 2) and seen[-1] == pytest.approx(SCHEDULE["min_lr"])


def test_a_skipped_step_keeps_its_place_in_the_schedule(single_rank, tmp_path, tiny_dirs):
    """Rollout step 1's advantages are NaN, so its two updates have non-finite gradients and are skipped (weights
    and Adam untouched); the LR of every update is still the formula at its step number, and the run ends at min_lr.
    Negative control: the former rule (a skipped step does not advance) would give steps 5 and 6 the schedule at
    3 and 4, far from min_lr."""
    calls = []

    @register_advantage("grpo_nan_at_step_1")
    def nan_once(rewards, group_ids, cfg):
        calls.append(1)
        adv = advantages("grpo")(rewards, group_ids, cfg)
        return adv * float("nan") if len(calls) == 2 else adv

    trainer = _schedule_trainer(tmp_path, tiny_dirs, "--algorithm.advantage", "grpo_nan_at_step_1")
    seen, skipped = [], []
    for step in range(3):
        before = {n: p.detach().clone() for n, p in trainer.actor.models()[0].named_parameters()}
        trainer.step(step)
        seen += [u["actor/lr"] for u in trainer.update_metrics]
        skipped.append(trainer.update_metrics[-1]["actor/skipped_steps"])
        if step == 1:
            assert all(torch.equal(before[n], p) for n, p in trainer.actor.models()[0].named_parameters())
    assert skipped == [0, 2, 2]
    assert seen == pytest.approx([_schedule(k, **SCHEDULE) for k in range(1, 7)], rel=1e-12, abs=1e-15)
    assert seen[-1] == pytest.approx(SCHEDULE["min_lr"])
    lagging = [_schedule(k, **SCHEDULE) for k in (3, 4)]
    assert min(abs(a - b) for a, b in zip(seen[-2:], lagging)) > 1e-4


def test_kl_in_reward_penalises_the_rewards_the_advantages_see(single_rank, tmp_path, tiny_dirs):
    """kl_in_reward: the advantages receive reward - kl_coef x sum_t (log pi_old - log pi_ref) per sample. Reference:
    HF transformers' forward at the rollout weights (the HF engine's logprobs of the tokens it sampled at step 1,
    after the first sync) and at the initial weights (the model folder, plain log_softmax(logits / T), float64). Step 0: the policy is the reference, the rewards
    pass unchanged. Negative control: the k3 estimator in place of k1 gives other rewards, caught."""
    from transformers import AutoModelForCausalLM

    seen = []

    @register_advantage("grpo_recording")
    def recording(rewards, group_ids, cfg):
        seen.append(torch.as_tensor(rewards, dtype=torch.float64).clone())
        return advantages("grpo")(rewards, group_ids, cfg)

    coef = 0.5
    trainer = make_trainer(
        tmp_path,
        tiny_dirs,
        "--train.steps",
        "2",
        "--algorithm.kl_coef",
        str(coef),
        "--algorithm.kl_in_reward",
        "true",
        "--algorithm.advantage",
        "grpo_recording",
    )
    batches = []
    real_collect = trainer.collect
    trainer.collect = lambda step: batches.append(real_collect(step)) or batches[-1]
    trainer.step(0)
    raw0 = torch.tensor([s.reward for s in batches[0][0]], dtype=torch.float64)
    assert torch.allclose(seen[0], raw0, atol=1e-5), "step 0: the policy is the reference"
    trainer.step(1)  # rollout and old logprobs at the weights synced after step 0
    samples = batches[1][0]
    ref = AutoModelForCausalLM.from_pretrained(trainer.cfg.model.path, dtype=torch.float64).eval()
    temp = trainer.cfg.rollout.temperature

    def logp_ref(s):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(ref(ids).logits[0].double() / temp, -1)
        n = len(s.prompt_ids)
        return logp[n - 1 : n - 1 + len(s.response_ids)].gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]

    k1, k3 = [], []
    for s in samples:  # the HF engine's own logprobs of what it sampled at the step's rollout weights
        old = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        d = (old - logp_ref(s)) * torch.tensor(s.loss_mask, dtype=torch.float64)
        k1.append(float(d.sum()))
        k3.append(float(((torch.exp(-d) + d - 1) * torch.tensor(s.loss_mask)).sum()))
    raw = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    expect = raw - coef * torch.tensor(k1, dtype=torch.float64)
    worst = float((seen[1] - expect).abs().max())
    print(
        f"kl_in_reward: max |rewards the advantages saw - HF reference| = {worst:.2e}; mean k1 {sum(k1) / len(k1):.4f}"
    )
    assert worst <= 1e-4 and float((raw - expect).abs().max()) > 1e-3, "the penalty is there and right"
    wrong = raw - coef * torch.tensor(k3, dtype=torch.float64)
    assert float((seen[1] - wrong).abs().max()) > 1e-3, "negative control: another estimator is caught"
    trainer.close()


def test_step_time_is_wall_clock(single_rank, tmp_path, tiny_dirs):
    """Work between the phases (here 0.3 s slept in completions logging, which no phase timer holds) shows in
    timing/step and timing/other; the former timing/step (the sum of the phases) misses it."""
    import time

    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "1")
    real = trainer.log.log_completions
    trainer.log.log_completions = lambda *a, **k: (time.sleep(0.3), real(*a, **k))
    started = time.perf_counter()
    m = trainer.step(0)
    outside = time.perf_counter() - started
    phases = sum(v for k, v in m.items() if k.startswith("timing/") and k not in ("timing/step", "timing/other"))
    print(
        f"timing/step {m['timing/step']:.3f} s (measured outside {outside:.3f} s), phases {phases:.3f} s, "
        f"other {m['timing/other']:.3f} s"
    )
    assert m["timing/other"] >= 0.3 and phases + 0.3 <= m["timing/step"] <= outside
    assert m["timing/step"] == pytest.approx(phases + m["timing/other"])
    assert m["perf/tokens_per_s"] == pytest.approx(m["response_length/mean"] * 64 / m["timing/step"])
    trainer.close()


def test_a_rejected_weight_update_stops_the_run_with_one_line(single_rank, tmp_path, tiny_dirs):
    """The engine refuses a weight version (here: the transport raises as an engine rejection would): the step
    fails on every rank with one RolloutError naming the version, and the engine keeps its old weights."""
    from mgrpo.rollout.manager import RolloutError
    from mgrpo.weights.sync import WeightSyncError

    trainer = make_trainer(tmp_path, tiny_dirs)
    before = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}

    def reject(named_tensors, version):
        next(iter(named_tensors))
        raise WeightSyncError("engine hf#0: update rejected before loading, old weights still serve: test")

    trainer.weight_sync.send = reject
    with pytest.raises(RolloutError, match="weight version 1 not applied: WeightSyncError: engine hf#0"):
        trainer.step(0)
    assert trainer.engine.version == 0
    assert all(torch.equal(before[n], p) for n, p in trainer.engine.model.named_parameters())
    trainer.close()
