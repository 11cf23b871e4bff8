"""LoRA runs through the launcher: the tiny LoRA example learns; a run saved at step 3 and resumed equals the
uninterrupted one bitwise (samples, losses, metrics, merged final weights) with the KL reference being the base
(adapters off); the converter writes merged HF weights and a PEFT folder that `peft` loads onto the HF base, both
giving the trainer's logits."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_checkpoint import LAUNCHER, ROOT, STEPS, _env, assert_same_run, launch, resume_copy  # noqa: E402

LORA = [
    "--model.lora.rank",
    "4",
    "--model.lora.alpha",
    "8",
    "--model.tiny.initializer_range",
    "0.1",
    "--algorithm.kl_coef",
    "0.01",
    "--train.lr",
    "0.01",
]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_resume")
    launch(root, "lora", *LORA)
    return root


def test_lora_resume_equals_the_uninterrupted_run(lora_runs):
    resume_copy(lora_runs, "lora", "lora_resumed", str(lora_runs / "lora-ckpt" / "step_000003"), *LORA)
    assert_same_run(
        lora_runs / "lora", lora_runs / "lora_resumed", lora_runs / "lora-ckpt", lora_runs / "lora_resumed-ckpt"
    )


def test_kl_to_the_base_equals_hf(single_rank, tiny_dirs, tmp_path):
    """The LoRA run's KL term (reference: the base, adapters off) against HF transformers: at step 1 the policy is
    the merged weights the HF engine sampled with (its logprobs of the tokens it drew) and the reference the model
    folder (float64, log_softmax(logits / T)); the logged k3 token mean equals theirs. Step 0 (B = 0: the policy is
    the base) gives exactly 0. Negative control: the k1 mean of the same tokens is caught."""
    from run_configs import tiny_run_config
    from transformers import AutoModelForCausalLM

    from mgrpo.trainer import GRPOTrainer

    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    cfg = tiny_run_config(
        model,
        tmp_path / "run",
        "--train.steps",
        "2",
        "--model.lora.rank",
        "4",
        "--model.lora.alpha",
        "8",
        "--algorithm.kl_coef",
        "0.01",
        "--train.lr",
        "0.05",
        "--logging.report",
        "false",
        "--logging.tensorboard",
        "false",
    )
    trainer = GRPOTrainer(cfg)
    batches, real = [], trainer.collect
    trainer.collect = lambda step: batches.append(real(step)) or batches[-1]
    first = trainer.step(0)
    assert first["actor/kl_ref"] == 0.0, "adapters start at B = 0: the policy is the base"
    trainer.step(1)
    got = trainer.update_metrics[0]["actor/kl_ref"]
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64).eval()
    d = []
    for s in batches[1][0]:
        ids, n = torch.tensor([s.prompt_ids + s.response_ids]), len(s.prompt_ids)
        with torch.no_grad():
            lp_ref = torch.log_softmax(ref(ids).logits[0] / cfg.rollout.temperature, -1)[n - 1 : -1]
        d.append(lp_ref.gather(1, ids[0, n:, None])[:, 0] - torch.tensor(s.rollout_logprobs, dtype=torch.float64))
    d = torch.cat(d)
    k3, k1 = float((torch.exp(d) - d - 1).mean()), float((-d).mean())
    print(f"LoRA step 1: actor/kl_ref {got:.6e}, HF k3 {k3:.6e} (k1 {k1:.3e})")
    assert got == pytest.approx(k3, rel=1e-4, abs=1e-8) and got > 1e-5
    assert abs(got - k1) > 1e-3 * k3
    trainer.close()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_converter_merged_and_peft_folders_give_the_same_logits(lora_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = str(lora_runs / "lora-ckpt" / f"step_{STEPS:06d}")
    for extra, out in (([], tmp_path / "merged"), (["--peft"], tmp_path / "peft")):
        r = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "launch", "convert_to_hf.py"),
                "--checkpoint",
                ckpt,
                "--output",
                str(out),
                *extra,
            ],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(str(lora_runs / "model"), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    trainer = AutoModelForCausalLM.from_pretrained(
        str(lora_runs / "lora-ckpt" / f"hf_step_{STEPS:06d}"), dtype=torch.float32
    ).eval()
    a, b, c = _logits(peft, ids), _logits(merged, ids), _logits(trainer, ids)
    assert (a - b).abs().max() <= 1e-5 and torch.equal(b, c)
    with peft.disable_adapter():
        off = _logits(peft, ids)
    assert (off - a).abs().max() > 1e-3, "the adapters changed the model"


def test_tiny_lora_example_learns(tmp_path):
    """examples/tiny_cpu_lora.yaml: last 5 steps' mean reward >= first 5 + 0.2."""
    r = subprocess.run(
        [
            sys.executable,
            LAUNCHER,
            "--config",
            os.path.join(ROOT, "examples", "tiny_cpu_lora.yaml"),
            "--model.path",
            str(tmp_path / "model"),
            "--model.tiny",
            "--logging.output_dir",
            str(tmp_path / "out"),
            "--logging.progress_bar",
            "false",
            "--logging.report",
            "false",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line)["reward/mean"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    first, last = sum(rows[:5]) / 5, sum(rows[-5:]) / 5
    print(f"tiny LoRA: reward first5 {first:.4f} last5 {last:.4f}")
    assert last >= first + 0.2
