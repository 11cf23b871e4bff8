"""SAPO with the top-entropy token mask and per-token entropies in completions.jsonl, through the trainer itself
(one in-process run): the flags reach the loss, the mask keeps about the asked share, the run header names both
sources, and the logged entropies equal HF transformers' own entropy of the same tokens at the rollout weights."""

import json

import pytest
import torch

Q = 0.2


@pytest.fixture(scope="module")
def run(single_rank, tiny_dirs, tmp_path_factory):
    from run_configs import tiny_run_config

    from mgrpo.config import describe_algorithm
    from mgrpo.trainer import GRPOTrainer

    out = tmp_path_factory.mktemp("entropy") / "run"
    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = tiny_run_config(
        model,
        out,
        "--train.steps",
        "2",
        "--logging.report",
        "false",
        "--logging.tensorboard",
        "false",
        "--logging.completions_interval",
        "1",
        "--logging.log_entropy",
        "true",
        "--logging.completions_token_ids",
        "true",
        "--algorithm.loss_type",
        "sapo",
        "--algorithm.top_entropy_quantile",
        str(Q),
        "--rollout.temperature",
        "0.9",
    )
    history = GRPOTrainer(cfg).fit()
    rows = [json.loads(line) for line in open(out / "completions.jsonl")]
    return cfg, model, history, rows, describe_algorithm(cfg)


def _hf_entropies(model, rows, temperature) -> list:
    """HF transformers' entropy of log_softmax(logits / T) at each response token of each row, float64."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    out = []
    for r in rows:
        ids, n = torch.tensor([r["prompt_ids"] + r["response_ids"]]), len(r["prompt_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0] / temperature, -1)
        out.append((-(logp.exp() * logp).sum(-1))[n - 1 : n - 1 + len(r["response_ids"])])
    return out


def test_sapo_and_the_mask_reach_the_loss(run):
    """References: the share of step 0's tokens the mask keeps is the share at or above the (1 - q) quantile of
    HF's entropies of those tokens at the rollout weights (the model folder); SAPO's mean gradient weight
    4 s (1 - s), s = sigmoid(tau (r - 1)), is exactly 1 with one update per rollout (r = 1). Negative control: the
    share a quantile of 0.3 would keep is caught."""
    cfg, model, history, rows, header = run
    assert cfg.algorithm.policy_loss == "sapo" and cfg.algorithm.aggregation == "seq-mean-token-mean"
    ent = torch.cat(_hf_entropies(model, [r for r in rows if r["step"] == 0], cfg.rollout.temperature))

    def kept(q):
        return float((ent >= torch.quantile(ent, 1 - q)).double().mean())

    got = history[0]["actor/entropy_mask_frac"]
    print(f"entropy mask: kept {got:.5f} of {ent.numel()} tokens, HF reference {kept(Q):.5f} (q=0.3: {kept(0.3):.5f})")
    assert got == pytest.approx(kept(Q), abs=1.5 / ent.numel())  # a token at the threshold may round either way
    assert abs(got - kept(0.3)) > 0.05
    for h in history:
        assert h["actor/sapo_grad_weight"] == pytest.approx(1.0, abs=1e-6)
    assert "arXiv:2511.20347" in header and "arXiv:2506.01939" in header


def test_logged_token_entropies_equal_hf_at_the_rollout_weights(run):
    from transformers import AutoModelForCausalLM

    cfg, model, _, rows, _ = run
    first = [r for r in rows if r["step"] == 0][:6]  # step 0: the rollout weights are the model folder's
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    worst, shifted = 0.0, 0.0
    for r in first:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        n_prompt = len(r["prompt_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].double() / cfg.rollout.temperature, -1)
        ent = -(logp.exp() * logp).sum(-1)  # position p predicts token p + 1
        want = ent[n_prompt - 1 : n_prompt - 1 + len(r["response_ids"])]
        got = r["token_entropy"]
        assert len(got) == len(r["response_ids"])
        for j, v in enumerate(got):
            if v is not None:
                worst = max(worst, abs(v - float(want[j])))
                if j + 1 < len(want):
                    shifted = max(shifted, abs(v - float(want[j + 1])))
    print(f"max |entropy - HF| = {worst:.2e} (one position off: {shifted:.2e})")
    assert worst <= 1e-4  # values are logged rounded to 4 decimals
    assert shifted > 1e-3  # negative control: one position off is caught (a random model is near-uniform)
