"""An independent gradient check of the training step: one micro-batch at TP1 in float64, the gradient mgrpo's actor
puts on every parameter (megatron model, fused vocab-parallel logprobs, the registered ppo_clip loss, aggregation
weights, the actor's loss scaling, DDP's grad buffers) against `torch.autograd` on HF transformers' own model with
the same weights and inputs, the loss written out here from the formulas:

    r_t = exp(logp_t - old_t),  l_t = max(-A r_t, -A clip(r_t, 1 - 0.2, 1 + 0.2)),  L = sum_t m_t l_t / sum_t m_t

(token-mean over the micro-batch's loss tokens, logp = log_softmax(logits / T) of each response token). Both models
run in float64 throughout, RoPE and RMSNorm included (HF's `Qwen2RotaryEmbedding` and megatron's `RotaryEmbedding`
compute their angles in float32 and HF's `Qwen2RMSNorm` normalises in float32, which alone puts both sides ~1e-7
apart: here both get the same float64 inverse frequencies, and HF's norms run in float64). The old
logprobs are HF's plus noise, so both clip branches carry tokens, and one sample has loss-mask-0 tokens in its
middle (a multi-turn environment reply). The layout matrix (tests/parallel/test_layouts.py) then holds TP2, PP2,
TP2xPP2 and the other layouts to this TP1 gradient.

Negative controls, each shown to fail the same comparison: the reference with the advantage's sign flipped, and
the reference without the loss mask.
"""

import pytest
import torch

from mgrpo.rollout.types import Sample

T = 0.8  # rollout.temperature: both sides divide the logits by it
TOL = 1e-12  # relative to the largest gradient entry of the parameter (float64 on both sides; 2.8e-15 seen)


@pytest.fixture(scope="module")
def setup(single_rank, tiny_dirs):
    from transformers import AutoModelForCausalLM

    model = tiny_dirs("grad_check_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    inv_freq = _inv_freq64(hf.config)

    def rope64(x, position_ids):
        emb = torch.cat([position_ids[..., None].double() * inv_freq] * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    hf.model.rotary_emb.forward = rope64
    for norm in (m for m in hf.modules() if type(m).__name__.endswith("RMSNorm")):  # HF's computes in float32
        norm.forward = lambda x, norm=norm: (
            norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
        )
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (n_prompt, n_resp) in enumerate([(5, 10), (7, 6), (4, 11), (6, 8)]):
        ids = torch.randint(3, 290, (n_prompt + n_resp,), generator=g).tolist()
        with torch.no_grad():
            logp = _hf_logprobs(hf, ids, n_prompt)
        mask = [1] * n_resp
        if i == 2:
            mask[3:6] = [0, 0, 0]  # an environment reply inside the response
        noise = (torch.rand(n_resp, generator=g, dtype=torch.float64) - 0.5) * 0.8
        samples.append(
            Sample(
                prompt_ids=ids[:n_prompt],
                response_ids=ids[n_prompt:],
                loss_mask=mask,
                rollout_logprobs=(logp + noise).float().double().tolist(),
            )
        )
    # inputs the micro-batches hold exactly (they are float32 there): old logprobs rounded to float32, advantages
    # that are binary fractions, and 32 loss tokens, so the token-mean weight 1/32 is exact too
    assert sum(sum(s.loss_mask) for s in samples) == 32
    advantages = [1.25, -0.75, 0.875, -1.625]
    return model, hf, samples, advantages


def _inv_freq64(config) -> torch.Tensor:
    """RoPE's inverse frequencies in float64: 1 / theta^(2i / head_dim)."""
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta
    dim = config.hidden_size // config.num_attention_heads
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _hf_logprobs(hf, ids: list, n_prompt: int) -> torch.Tensor:
    """log_softmax(logits / T) of each response token: position p predicts token p + 1."""
    logits = hf(torch.tensor([ids])).logits[0].double() / T
    logp = torch.log_softmax(logits, -1)
    targets = torch.tensor(ids[n_prompt:])
    return logp[n_prompt - 1 : len(ids) - 1].gather(1, targets[:, None])[:, 0]


def _reference_grads(hf, samples, advantages, sign: float = 1.0, use_mask: bool = True) -> dict:
    """HF autograd of the loss written out above; `sign` and `use_mask` break it for the negative controls."""
    hf.zero_grad()
    total, tokens = 0.0, 0.0
    for s, a in zip(samples, advantages):
        ids = s.prompt_ids + s.response_ids
        logp = _hf_logprobs(hf, ids, len(s.prompt_ids))
        old = torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        m = torch.tensor(s.loss_mask if use_mask else [1] * len(s.loss_mask), dtype=torch.float64)
        r = torch.exp(logp - old)
        adv = sign * a
        loss_t = torch.maximum(-adv * r, -adv * torch.clamp(r, 0.8, 1.2))
        total = total + (m * loss_t).sum()
        tokens += float(m.sum())
    (total / tokens).backward()
    return {n: p.grad.detach().clone() for n, p in hf.named_parameters()}


@pytest.fixture(scope="module")
def mgrpo_grads(setup):
    """The actor's gradient of one micro-batch (all four samples), HF-named, float64 throughout."""
    from mgrpo.actor import Actor
    from mgrpo.config import load_config
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.loss.aggregation import token_weights
    from mgrpo.weights.export import full_hf_tensors

    model, _, samples, advantages = setup
    cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            "x.jsonl",
            "--rollout.temperature",
            str(T),
            "--train.micro_batch_size",
            "4",
        ],
        check_files=False,
    )
    cfg.model.params_dtype = "float64"  # not a training setting: this check's precision
    actor = Actor(cfg, model)
    gpt = actor.models()[0]
    assert next(gpt.parameters()).dtype == torch.float64
    gpt.rotary_pos_emb.inv_freq = _inv_freq64(setup[1].config)  # float64 angles, as on the HF side
    weights = token_weights(samples, "token-mean")
    mbs = make_microbatches(samples, 4, 0, advantages, token_weights=weights)
    assert len(mbs) == 1
    for mb in mbs:  # the batch's float fields (fp32 in training, exact here) in float64, as the model computes
        mb.update({k: v.double() for k, v in mb.items() if torch.is_tensor(v) and v.is_floating_point()})
        mb["old_logp"] = mb["rollout_logp"]
    actor.forward_backward(mbs)
    grads = dict(full_hf_tensors(actor.chunks, lambda p: p.main_grad.clone()))
    assert all(g.dtype == torch.float64 for g in grads.values())
    return grads


def _worst(ours: dict, ref: dict) -> tuple:
    """(worst relative difference, its parameter) over every parameter, relative to the parameter's largest
    reference gradient entry."""
    assert ours.keys() == ref.keys(), sorted(ours.keys() ^ ref.keys())
    worst, where = 0.0, ""
    for name in ref:
        assert ours[name].shape == ref[name].shape, name
        rel = float((ours[name] - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-30))
        if rel > worst:
            worst, where = rel, name
    return worst, where


def test_policy_gradient_equals_hf_autograd(setup, mgrpo_grads):
    _, hf, samples, advantages = setup
    ref = _reference_grads(hf, samples, advantages)
    assert all(float(g.abs().max()) > 0 for g in ref.values()), "every parameter gets a gradient"
    worst, where = _worst(mgrpo_grads, ref)
    print(f"{len(ref)} parameters: max relative gradient difference vs HF autograd {worst:.2e} ({where})")
    assert worst <= TOL


@pytest.mark.parametrize("error", ["advantage_sign", "missing_mask"])
def test_a_deliberate_error_fails_the_check(setup, mgrpo_grads, error):
    _, hf, samples, advantages = setup
    kwargs = {"sign": -1.0} if error == "advantage_sign" else {"use_mask": False}
    worst, where = _worst(mgrpo_grads, _reference_grads(hf, samples, advantages, **kwargs))
    print(f"negative control {error}: max relative gradient difference {worst:.2e} ({where})")
    assert worst > 1e-3
