"""`train.offload` (mgrpo/actor_offload.py): the trainer's optimizer state, gradients and parameters parked on the
host between steps, their storages emptied and refilled in place. Two steps with an offload and a restore
around each equal two steps without, bitwise (every parameter, Adam's state, the LR), with megatron's
distributed optimizer and with plain DDP; while parked, every storage the level names holds 0 bytes. A restore that leaves the
parameters zeroed (the negative control: what discarding instead of copying gives) is caught by the same check.
"""

import pytest
import torch
from layout_check import _state_snapshot

from mgrpo.actor import Actor
from mgrpo.actor_offload import Offloader, _ddp_buffers, _optimizer_tensors
from mgrpo.config import load_config
from mgrpo.data.microbatch import make_microbatches
from mgrpo.loss.aggregation import token_weights
from mgrpo.loss.policy import aggregation_of
from mgrpo.rollout.types import Sample


def _samples() -> list:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        p, r = 5 + i, 4 + 2 * i
        s = Sample(
            prompt_ids=torch.randint(3, 300, (p,), generator=g).tolist(),
            response_ids=torch.randint(3, 300, (r,), generator=g).tolist(),
            loss_mask=[1] * r,
            group_id=i // 4,
            info={"advantage": float(torch.randn((), generator=g))},
        )
        s.rollout_logprobs = (-5 * torch.rand(r, generator=g)).tolist()
        out.append(s)
    return out


@pytest.fixture(scope="module", params=["true", "false"], ids=["distopt", "ddp"])
def setup(single_rank, tiny_dirs, request):
    """megatron's distributed optimizer (a param buffer, fp32 main params as its views) or plain DDP (the
    optimizer holds the model's own parameters)."""
    model_dir = tiny_dirs("offload")
    cfg = load_config(
        argv=[
            "--model.path",
            model_dir,
            "--data.path",
            "unused.jsonl",
            "--train.use_distributed_optimizer",
            request.param,
        ],
        check_files=False,
    )
    samples = _samples()
    weights = token_weights(samples, aggregation_of(cfg.algorithm), cfg.rollout.max_tokens)

    def batch():
        mbs = make_microbatches(samples, 4, 0, [s.info["advantage"] for s in samples], 1, token_weights=weights)
        for mb in mbs:
            mb["old_logp"] = mb["rollout_logp"]
        return mbs

    return cfg, model_dir, batch


def _parked_bytes(actor, level: str) -> dict:
    """Bytes still held by what `level` names. The optimizer's fp32 main params are views of the model's own
    parameter buffer in an fp32 run: they stay with it (and go at level `all`)."""
    buffers = _ddp_buffers(actor.chunks)
    own = {p.untyped_storage().data_ptr() for c in actor.chunks for p in c.parameters()} - {0}
    held = [t.untyped_storage() for t in _optimizer_tensors(actor.optimizer)]
    out = {"optimizer": sum(s.nbytes() for s in held if s.data_ptr() not in own)}
    if level in ("optimizer+grads", "all"):
        out["grads"] = sum(b.grad_data.untyped_storage().nbytes() for b in buffers)
    if level == "all":
        out["params"] = sum(p.untyped_storage().nbytes() for c in actor.chunks for p in c.parameters())
    return out


def _two_steps(cfg, model_dir, batch, level: str | None, spoil=None) -> tuple:
    actor = Actor(cfg, model_dir)
    offloader = Offloader(level or "none", actor.chunks, actor.optimizer)
    moved, parked = [], []
    for _ in range(2):
        actor.train_step(batch())
        if level:
            moved.append(offloader.offload())
            parked.append(_parked_bytes(actor, level))
            offloader.restore()
            if spoil:
                spoil(actor)
    return _state_snapshot(actor), moved, parked


@pytest.mark.parametrize("level", ["optimizer", "optimizer+grads", "all"])
def test_offload_and_restore_leave_the_run_bitwise_unchanged(setup, level):
    cfg, model_dir, batch = setup
    ref, _, _ = _two_steps(cfg, model_dir, batch, None)
    got, moved, parked = _two_steps(cfg, model_dir, batch, level)
    print(f"{level}: moved per offload {moved[-1]} bytes; held while parked {parked[-1]}")
    assert all(v == 0 for p in parked for v in p.values()), parked
    assert moved[-1]["optimizer"] > 0 and (level == "optimizer" or moved[-1]["grads"] > 0)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_restore_that_loses_the_parameters_is_caught(setup):
    cfg, model_dir, batch = setup
    ref, _, _ = _two_steps(cfg, model_dir, batch, None)

    def zero_params(actor):
        for c in actor.chunks:
            for p in c.parameters():
                p.data.zero_()

    got, _, _ = _two_steps(cfg, model_dir, batch, "all", spoil=zero_params)
    assert any(not torch.equal(got[k], ref[k]) for k in ref if k.startswith("param:"))


def test_a_second_offload_before_a_restore_is_refused(setup):
    cfg, model_dir, _ = setup
    actor = Actor(cfg, model_dir)
    offloader = Offloader("all", actor.chunks, actor.optimizer)
    offloader.offload()
    with pytest.raises(RuntimeError, match="offloaded already"):
        offloader.offload()
    offloader.restore()
    with pytest.raises(ValueError, match="train.offload='gpu'"):
        Offloader("gpu", actor.chunks, actor.optimizer)
