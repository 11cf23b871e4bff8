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
    cfg = load_config(os.path.join(ROOT, "examples", "tiny_cpu.yaml"), [
        "--model.path", model, "--data.path", os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
        "--logging.output_dir", str(tmp_path / "run"), "--logging.progress_bar", "false",
        "--train.steps", str(STEPS), *extra])
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
    """The launcher under torchrun at TP2 x PP2 with every optional loss term, a checkpoint, and its conversion."""
    import json
    import subprocess
    import sys

    from mgrpo.parallel.distributed import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={free_port()}",
           os.path.join(ROOT, "launch", "train_grpo.py"), "--config", os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
           "--tp", "2", "--pp", "2", "--train.steps", "2", "--model.path", str(tmp_path / "model"), "--model.tiny",
           "--checkpoint.save_dir", str(tmp_path / "ckpt"), "--checkpoint.save_interval", "2",
           "--logging.output_dir", str(tmp_path / "run"), "--logging.progress_bar", "false",
           "--algorithm.kl_coef", "0.01", "--algorithm.entropy_coef", "0.001", "--algorithm.rollout_is_mode", "tis"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [0, 1]
    last = rows[-1]
    assert last["actor/entropy"] > 0 and last["weight_version"] == 2
    assert "actor/kl_ref" in last and last["actor/kl_ref"] >= 0, "the KL loss term against the reference is reported"
    assert last["actor/skipped_steps"] == 0 and last["rollout_is/missing_logprob_samples"] == 0
    assert "algorithm (value, from):" in r.stdout and "kl_coef                0.01" in r.stdout
    # the engine sampled with the weights the trainer synced: its logprobs equal the trainer's old logprobs
    assert last["rollout_is/rollout_logp_abs_diff"] < 1e-4
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "convert_to_hf.py"), "--checkpoint",
                        str(tmp_path / "ckpt" / "step_000002"), "--output", str(out)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))


def test_kl_in_reward_step(single_rank, tmp_path, tiny_dirs):
    """With kl_in_reward the reference policy's k1 per sequence is subtracted from the reward before advantages."""
    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "1", "--algorithm.kl_coef", "0.1",
                           "--algorithm.kl_in_reward", "true")
    first = trainer.step(0)
    assert first["actor/kl_ref"] == pytest.approx(0.0, abs=1e-5), "before any update the policy is the reference"
    second = trainer.step(1)
    assert second["actor/kl_ref"] != 0.0


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

    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "1", "--reward.funcs", "[token_fraction, _t_flaky]",
                           "--algorithm.loss_type", "cispo", "--algorithm.kl_coef", "0.05")
    m = trainer.step(0)
    n = trainer.cfg.rollout.n * trainer.cfg.rollout.prompts_per_step
    assert 0 < m["reward/failed"] < n and m["actor/skipped_steps"] == 0
    for key in ("actor/clip_frac", "actor/kl_ref", "reward/std", "reward/mean", "actor/loss",
                "actor/grad_norm", "actor/entropy", "timing/step", "perf/tokens_per_s"):
        assert key in m and math.isfinite(m[key]), key
    assert trainer.cfg.algorithm.policy_loss == "cispo"


def _launch(tmp_path, name, *extra, nproc=2):
    import subprocess
    import sys

    from mgrpo.parallel.distributed import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    out = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           os.path.join(ROOT, "launch", "train_grpo.py"), "--config", os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
           "--train.steps", "2", "--model.path", str(tmp_path / "model"), "--model.tiny",
           "--logging.output_dir", str(out),
           "--logging.progress_bar", "false", "--logging.completions_interval", "1",
           "--logging.completions_token_ids", "true", "--logging.report", "false", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    return ([json.loads(line) for line in open(out / "metrics.jsonl")],
            [json.loads(line) for line in open(out / "completions.jsonl")])


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
    assert [(key(r), r["response_ids"]) for r in sorted(one, key=key)] == \
        [(key(r), r["response_ids"]) for r in sorted(two, key=key)]
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


def test_cosine_schedule_with_warmup_follows_the_formula(single_rank, tmp_path, tiny_dirs):
    """3 rollout steps x 2 mini-batches = 6 optimizer steps: linear warmup over 2 from 0, then cosine to min_lr
    at the last step; actor/lr is the LR each update used."""
    import math

    lr, min_lr, warm, total = 0.003, 0.0003, 2, 6
    trainer = make_trainer(tmp_path, tiny_dirs, "--train.steps", "3", "--train.steps_per_generation", "2",
                           "--train.lr_schedule", "cosine", "--train.warmup_steps", str(warm), "--train.min_lr",
                           str(min_lr), "--train.lr", str(lr))
    seen = []
    for step in range(3):
        m = trainer.step(step)
        seen += [u["actor/lr"] for u in trainer.update_metrics]
        assert m["actor/lr"] == seen[-1]

    def reference(k):
        if k <= warm:
            return lr * k / warm
        ratio = (k - warm) / (total - 1 - warm)
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))

    assert seen == pytest.approx([reference(k) for k in range(total)], rel=1e-12, abs=1e-15)
    assert seen[-1] == pytest.approx(min_lr)


def test_a_rejected_weight_update_stops_the_run_with_one_line(single_rank, tmp_path, tiny_dirs):
    """The engine refuses a weight version (here: the transport raises as an engine rejection would): the step
    fails on every rank with one RolloutError naming the version, and the engine keeps its old weights."""
    from mgrpo.rollout.manager import RolloutError
    from mgrpo.rollout.transports.base import WeightSyncError

    trainer = make_trainer(tmp_path, tiny_dirs)
    before = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}

    def reject(named_tensors, version):
        next(iter(named_tensors))
        raise WeightSyncError("engine hf#0: update rejected before loading, old weights still serve: test")

    trainer.transport.send = reject
    with pytest.raises(RolloutError, match="weight version 1 not applied: WeightSyncError: engine hf#0"):
        trainer.step(0)
    assert trainer.engine.version == 0
    assert all(torch.equal(before[n], p) for n, p in trainer.engine.model.named_parameters())
    trainer.close()
