"""bf16 training (model.params_dtype: bfloat16) on CPU through megatron's mixed-precision optimizer: bf16 weights and
forward, fp32 master weights and fp32 gradients (DDP reduces in fp32), and the main job learns. Logprobs of the bf16
forward are checked against a float64 log_softmax of HF's fp32 forward (tolerance 0.05 nats per token: bf16 keeps 8
mantissa bits), and must differ from it (the negative control: the run really is bf16)."""

import torch
from test_trainer import _rise, make_trainer

from mgrpo.data.microbatch import make_microbatches


def _inner(opt):
    """The mixed-precision optimizer inside megatron's ChainedOptimizer (one per model chunk)."""
    return opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt


def test_bf16_main_job_learns_with_fp32_master_weights(single_rank, tmp_path, tiny_dirs):
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tmp_path, tiny_dirs, "--model.params_dtype", "bfloat16")
    params = list(trainer.actor.models()[0].parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    opt = _inner(trainer.actor.optimizer)
    assert isinstance(opt, Float16OptimizerWithFloat16Params), type(opt)
    masters = [p for group in opt.fp32_from_float16_groups for p in group]
    assert masters and {p.dtype for p in masters} == {torch.float32}

    sample = trainer.rollout_and_score(0)[0]
    mb = make_microbatches([sample], 1, trainer.tokenizer.pad_token_id)[0]
    ours = trainer.actor.logprobs([mb])[0][mb["loss_mask"].bool()].double()
    ref_model = AutoModelForCausalLM.from_pretrained(trainer.cfg.model.path, dtype=torch.float32)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = ref_model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].double()
    ref = torch.log_softmax(logits / trainer.cfg.rollout.temperature, -1).gather(
        -1, ids[0, len(sample.prompt_ids) :, None]
    )[:, 0]
    diff = (ours - ref).abs().max().item()
    print(f"bf16 vs fp32 logprobs: max |diff| {diff:.3e} over {len(ref)} tokens")
    assert 0 < diff < 0.05

    history = trainer.fit()
    first, last = _rise(history)
    print(f"bf16 reward first3 {first:.3f} -> last3 {last:.3f}")
    assert last >= first + 0.1
    assert all(torch.isfinite(torch.tensor(h["actor/loss"])) for h in history)
    grads = [p.main_grad for p in trainer.actor.chunks[0].module.parameters() if hasattr(p, "main_grad")]
    assert grads and {g.dtype for g in grads} == {torch.float32}, "gradients are kept and reduced in fp32"
    # fp32 masters carry bits bf16 cannot hold; the bf16 weights are exactly the masters rounded
    masters = [p for group in opt.fp32_from_float16_groups for p in group]
    models = [p for group in opt.float16_groups for p in group]
    assert any((m != m.to(torch.bfloat16).float()).any() for m in masters)
    assert all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(masters, models))
