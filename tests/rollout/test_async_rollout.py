"""Asynchronous rollout (mgrpo/rollout/producer.py) on the tiny task with the in-process HF engine:

- `rollout.mode: async` with `max_staleness: 0` runs the producer's machinery (a background thread, nothing ahead)
  and gives bitwise the sync run: every logged number and every weight;
- async with staleness 2: every generated sample is trained exactly once or counted as dropped (ids counted over
  the run), staleness stays within the bound and reaches it, and the task learns; one_step_off learns too;
- a run resumed from a checkpoint taken while the next batch was in flight (one_step_off) trains the stored batch
  and continues bitwise as the uninterrupted run.
"""

import os

import pytest
import torch

from mgrpo.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISE = ("timing/", "perf/", "async/", "rollout/engine_idle_frac", "rollout/partial_samples")  # times, ahead modes' own


def make(tmp_path, tiny_dirs, *extra):
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
            *extra,
        ],
    )
    cfg.model.tiny = None
    return GRPOTrainer(cfg)


def logged(history):
    return [{k: v for k, v in h.items() if not k.startswith(NOISE)} for h in history]


def weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.actor.models()[0].named_parameters()}


def test_staleness_zero_is_bitwise_sync(single_rank, tmp_path, tiny_dirs):
    sync = make(tmp_path / "sync", tiny_dirs, "--train.steps", "6")
    h_sync, w_sync = sync.fit(), weights(sync)
    zero = make(
        tmp_path / "zero", tiny_dirs, "--train.steps", "6", "--rollout.mode", "async", "--rollout.max_staleness", "0"
    )
    assert zero.producer.threaded and zero.producer.k == 0
    h_zero, w_zero = zero.fit(), weights(zero)
    assert logged(h_sync) == logged(h_zero)
    assert all(torch.equal(w_sync[n], w_zero[n]) for n in w_sync)
    print(
        f"async, max_staleness 0: 6 steps, {len(logged(h_sync)[0])} metrics per step and all "
        f"{len(w_sync)} weights bitwise equal to sync"
    )


@pytest.mark.parametrize("mode", ["async", "one_step_off"])
def test_ahead_modes_learn_and_use_every_sample_once(single_rank, tmp_path, tiny_dirs, mode):
    steps = 24
    trainer = make(tmp_path, tiny_dirs, "--train.steps", str(steps), "--rollout.mode", mode)
    generated, trained = [], []
    generate, batch = trainer.rollout.generate_local, trainer.producer.batch

    def ids(group_ids):
        """(group, k-th sample of the group) for each sample: an id unique over the run."""
        seen = {}
        for g in group_ids:
            seen[g] = seen.get(g, -1) + 1
            yield g, seen[g]

    def counting_generate(rows, step, *a, **kw):  # on the producer's thread
        payload = generate(rows, step, *a, **kw)
        generated.extend(ids(s["group_id"] for s in payload["samples"]))
        return payload

    def counting_batch(step, version):
        samples, metrics = batch(step, version)
        trained.extend(ids(s.group_id for s in samples))
        return samples, metrics

    trainer.rollout.generate_local, trainer.producer.batch = counting_generate, counting_batch
    history = trainer.fit()
    bound = 2 if mode == "async" else 1
    first, last = (sum(h["reward/mean"] for h in part) / 5 for part in (history[:5], history[-5:]))
    dropped = sum(h["async/discarded"] for h in history)
    stale = [h["async/staleness_max"] for h in history]
    print(
        f"{mode}: reward first5 {first:.4f} last5 {last:.4f}; {len(generated)} samples generated, "
        f"{len(trained)} trained, {dropped} dropped; staleness max per step {stale}"
    )
    assert len(trained) == len(set(trained)), "a sample trained twice"
    assert sorted(trained) == sorted(generated) and dropped == 0, "a sample lost"
    assert max(stale) == bound and all(s <= bound for s in stale)
    assert last >= first + 0.2


def test_resume_with_a_batch_in_flight_continues_bitwise(single_rank, tmp_path, tiny_dirs):
    args = ["--train.steps", "6", "--rollout.mode", "one_step_off", "--checkpoint.save_interval", "3"]
    whole = make(tmp_path / "whole", tiny_dirs, *args, "--checkpoint.save_dir", str(tmp_path / "ckpt"))
    h_whole, w_whole = whole.fit(), weights(whole)
    ckpt = os.path.join(tmp_path, "ckpt", "step_000003")
    resumed = make(
        tmp_path / "resumed",
        tiny_dirs,
        *args,
        "--checkpoint.save_dir",
        str(tmp_path / "ckpt2"),
        "--checkpoint.resume",
        ckpt,
    )
    assert resumed.start_step == 3 and 3 in resumed.producer.pending, "the stored in-flight batch is restored"
    h_resumed, w_resumed = resumed.fit(), weights(resumed)
    assert logged(h_whole)[3:] == logged(h_resumed)
    assert all(torch.equal(w_whole[n], w_resumed[n]) for n in w_whole)
    print(
        "one_step_off resumed at step 3 with step 3's batch in flight: steps 3-5 and the final weights bitwise "
        "equal to the uninterrupted run"
    )


def test_truncated_is_weights_the_loss_received(single_rank, tmp_path, tiny_dirs, monkeypatch):
    """async (staleness 2) turns on token_truncate: every micro-batch's policy loss receives w = min(exp(old -
    behaviour), 2) on its loss tokens, computed here in float64 from the same micro-batch's behaviour logprobs
    (the engine's, `rollout_logp`) and current ones (the loss's old_logp: the trainer's at the weights it trains).
    Stale samples make the weights differ from 1, so weights of 1 (no correction) would be caught."""
    import mgrpo.actor

    received, batches = [], []
    real_loss = mgrpo.actor.policy_loss

    def recording_loss(name):
        fn = real_loss(name)

        def wrapped(logp, old_logp, advantages, mask, cfg, **kw):
            received.append((old_logp.detach().double(), mask.double(), kw["rollout_is_weights"].detach().double()))
            return fn(logp, old_logp, advantages, mask, cfg, **kw)

        return wrapped

    monkeypatch.setattr(mgrpo.actor, "policy_loss", recording_loss)
    trainer = make(tmp_path, tiny_dirs, "--train.steps", "6", "--rollout.mode", "async")
    assert trainer.cfg.algorithm.rollout_is_mode == "token_truncate"
    real_fb = trainer.actor.forward_backward
    trainer.actor.forward_backward = lambda mbs: batches.extend(mbs) or real_fb(mbs)
    history = trainer.fit()
    assert len(received) == len(batches) > 0
    worst, off_one = 0.0, 0.0
    for (old, mask, w), mb in zip(received, batches):
        behaviour = mb["rollout_logp"].double()
        ref = torch.clamp(torch.exp(torch.clamp(old - behaviour, -20, 20)), max=2.0) * mask
        worst = max(worst, float((w * mask - ref).abs().max()))
        off_one = max(off_one, float(((ref - 1) * mask).abs().max()))
    stale = max(h["async/staleness_max"] for h in history)
    print(
        f"async TIS: {len(received)} micro-batches, max |w - float64 reference| {worst:.2e}, max |w - 1| "
        f"{off_one:.3f}, staleness up to {stale}"
    )
    assert worst <= 1e-6 and off_one > 1e-2 and stale == 2
