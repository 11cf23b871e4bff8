"""The loss side is device-agnostic: every policy loss (with KL to a reference and the rollout correction in
every mode), the aggregation weights and the fused logprob kernel run on `meta` tensors (standing in for CUDA) and
give `meta` results. A tensor made on the CPU inside them (a hard-coded `torch.tensor(...)`) fails here."""

import dataclasses

import pytest
import torch

import mgrpo.loss.policy  # noqa: F401  (registers the built-in policy losses)
from mgrpo.config import AlgorithmConfig
from mgrpo.loss.registry import POLICY_LOSSES, policy_loss
from mgrpo.loss.rollout_correction import MODES, rollout_is_weights_from_cfg, rollout_offpolicy_metrics

B, L, V = 3, 7, 50


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def seq_sum(x):
    return x.sum(-1)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_losses_stay_on_the_device(name):
    alg = dataclasses.replace(AlgorithmConfig(), policy_loss=name, kl_coef=0.1, clip_ratio_c=3.0)
    logp, old, adv, mask, ref = meta(B, L), meta(B, L), meta(B, L), meta(B, L), meta(B, L)
    per_token, metrics = policy_loss(name)(
        logp, old, adv, mask, alg, ref_logp=ref, rollout_is_weights=meta(B, L), seq_sum=seq_sum
    )
    assert per_token.device.type == "meta"
    assert all(v.device.type == "meta" for v in metrics.values() if isinstance(v, torch.Tensor)), metrics


@pytest.mark.parametrize("mode", MODES)
def test_rollout_correction_stays_on_the_device(mode):
    alg = dataclasses.replace(AlgorithmConfig(), rollout_is_mode=mode, rollout_is_lower=0.5)
    w, metrics = rollout_is_weights_from_cfg(
        meta(B, L), meta(B, L), meta(B, L), alg, seq_sum=seq_sum, has_rollout=meta(B, L)
    )
    assert w.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())
    assert all(v.device.type == "meta" for v in rollout_offpolicy_metrics(meta(B, L), meta(B, L), meta(B, L)).values())


def test_fused_logprobs_stay_on_the_device():
    from mgrpo.loss.logprobs import vocab_parallel_logprobs

    logits = meta(B, L, V).requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        logits,
        torch.zeros(B, L, dtype=torch.long, device="meta"),
        None,
        temperature=0.7,
        compute_entropy=True,
        vocab_size=V - 3,
    )
    assert lp.device.type == "meta" and ent.device.type == "meta"
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.device.type == "meta"
