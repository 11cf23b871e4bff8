"""algorithm.overlong_filter: samples that stopped at rollout.max_tokens get loss mask 0. With every sample truncated
the step trains nothing: zero gradients, unchanged weights, and a warning that says why. Without the filter the
same step moves the weights (the negative control)."""

import logging
import os

import torch

from mgrpo.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step_with_every_sample_truncated(tmp_path, tiny_dirs, overlong_filter: bool):
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
            str(tmp_path / f"run{int(overlong_filter)}"),
            "--logging.progress_bar",
            "false",
            "--train.steps",
            "1",
            "--rollout.max_tokens",
            "6",
            "--algorithm.overlong_filter",
            str(overlong_filter),
        ],
    )
    cfg.model.tiny = None
    trainer = GRPOTrainer(cfg)
    trainer.engine.eos = -1  # the engine never stops early: every sample ends at max_tokens
    before = [p.detach().clone() for p in trainer.actor.models()[0].parameters()]
    metrics = trainer.step(0)
    after = list(trainer.actor.models()[0].parameters())
    moved = max((a.detach() - b).abs().max().item() for a, b in zip(after, before))
    trainer.close()
    return metrics, moved


def test_all_truncated_samples_give_zero_gradients_and_a_warning(single_rank, tmp_path, tiny_dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="mgrpo.batching"):
        metrics, moved = step_with_every_sample_truncated(tmp_path, tiny_dirs, overlong_filter=True)
    assert metrics["response_length/clip_ratio"] == 1.0
    assert metrics["response_length/overlong_filtered"] == 64
    assert metrics["actor/grad_norm"] == 0.0 and moved == 0.0
    assert "all 64 samples stopped at rollout.max_tokens=6 and algorithm.overlong_filter masks them" in caplog.text
    metrics, moved = step_with_every_sample_truncated(tmp_path, tiny_dirs, overlong_filter=False)
    assert metrics["actor/grad_norm"] > 0 and moved > 0, "without the filter the same samples train"
    assert "response_length/overlong_filtered" not in metrics


def test_only_truncated_samples_lose_their_loss_mask(single_rank):
    from mgrpo.config import Config
    from mgrpo.data.batching import build_generation_batch
    from mgrpo.rollout.types import Sample

    cfg = Config()
    cfg.algorithm.overlong_filter, cfg.rollout.prompts_per_step, cfg.rollout.n = True, 2, 2
    samples = [
        Sample([1, 2], [3, 4, 5], [1, 1, 1], reward=r, group_id=g, finish_reason=f)
        for r, g, f in ((1.0, 0, "stop"), (0.0, 0, "length"), (0.5, 1, "length"), (0.2, 1, "stop"))
    ]
    batch = build_generation_batch(samples, cfg, pad_id=0)
    assert [s.loss_mask for s in samples] == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]]
    weights = torch.cat([mb["token_weight"].flatten() for mb in batch.minibatches[0].microbatches])
    assert float(weights.sum()) == 1.0  # token-mean over the 6 tokens that still count
    assert batch.valid.tolist() == [True] * 4  # their rewards still count in the group statistics
