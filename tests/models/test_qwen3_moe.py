"""Qwen3-MoE pieces: config.json parsing (dense layers, top-k renormalisation), the HF parity negative control
(two experts swapped in the mapping), router metrics against HF's own load-balancing loss (float64), the config
errors of MoE layouts, and the tiny MoE task learning at EP2 under torchrun with moe/ metrics logged."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_hf_parity import CASES, assert_close, hf_logits, megatron_logits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_moe_spec_follows_hf_layer_rule():
    from mgrpo.models.qwen3_moe import qwen3_moe_spec

    raw = dict(
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=True,
    )
    spec = qwen3_moe_spec(raw)
    # HF: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert spec.sparse_layers == (False, True, False, False, False, True)
    assert (spec.num_experts, spec.topk, spec.ffn_hidden_size, spec.norm_topk_prob) == (16, 4, 32, True)


def test_moe_parity_fails_with_two_experts_swapped(single_rank, tiny_dirs, monkeypatch):
    """Negative control for test_hf_parity's qwen3_moe case: experts 0 and 1 of every layer read each other's
    tensors; the same comparison must fail."""
    from mgrpo.weights import mappings

    def swapped(self, reader, rank, size):
        e = self.ep_rank * self.per_rank + self.local
        return self.of({0: 1, 1: 0}.get(e, e)).shard(reader, rank, size)

    hf_dir = tiny_dirs("qwen3_moe", **CASES["qwen3_moe"])
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf_dir, ids)
    monkeypatch.setattr(mappings.Expert, "shard", swapped)
    with pytest.raises(AssertionError):
        assert_close(megatron_logits(hf_dir, ids, single_rank), ref)


def test_router_metrics_equal_hf_load_balancing_loss(single_rank, tiny_dirs):
    """RouterStats on megatron's routers (padding excluded through the micro-batch's valid mask) against HF's
    `load_balancing_loss_func` on HF's router logits of the same tokens, in float64; and tokens per expert against
    a count of HF's top-k picks."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from mgrpo.models.builder import build_model
    from mgrpo.models.router_stats import RouterStats, tokens_of
    from mgrpo.weights.load import load_hf

    hf_dir = tiny_dirs("qwen3_moe", **CASES["qwen3_moe"])
    g = torch.Generator().manual_seed(3)
    lengths = [40, 27]
    ids = torch.randint(0, 300, (2, 40), generator=g)
    valid = torch.arange(40)[None] < torch.tensor(lengths)[:, None]
    chunks = build_model(hf_dir, single_rank)
    load_hf(chunks, hf_dir)
    info = chunks[0].mgrpo_info
    stats = RouterStats(chunks, info.num_hidden_layers, info.moe.num_experts, info.moe.topk, False)
    with stats.collect(), tokens_of(valid), torch.no_grad():
        chunks[0](
            ids, torch.arange(40)[None].expand(2, -1), torch.triu(torch.ones(40, 40, dtype=torch.bool), 1)[None, None]
        )
    got = stats.reduce()
    with stats.collect(), torch.no_grad():  # negative control: the 13 padding tokens counted as well
        chunks[0](
            ids, torch.arange(40)[None].expand(2, -1), torch.triu(torch.ones(40, 40, dtype=torch.bool), 1)[None, None]
        )
    padded = stats.reduce()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logits = {}
    handles = [
        m.register_forward_hook(lambda mod, a, out, n=n: logits.__setitem__(n, out[0]))
        for n, m in hf.named_modules()
        if n.endswith("mlp.gate")
    ]
    with torch.no_grad():
        for row, n in enumerate(lengths):  # one sequence at a time: no padding in HF's forward either
            hf(ids[row : row + 1, :n].clone())
            for name in [k for k in logits if isinstance(k, str)]:
                logits[(name, row)] = logits.pop(name)
    for h in handles:
        h.remove()
    for layer in (0, 2):  # layer 1 is dense (mlp_only_layers)
        name = f"model.layers.{layer}.mlp.gate"
        per_layer = torch.cat([logits[(name, r)] for r in range(2)]).double()
        ref = float(load_balancing_loss_func((per_layer,), info.moe.num_experts, info.moe.topk)) / info.moe.topk
        ours = got[f"moe/layer_{layer:02d}/aux_loss"]
        picks = per_layer.softmax(-1).topk(info.moe.topk, -1).indices.flatten()
        counts = torch.bincount(picks, minlength=info.moe.num_experts).double()
        print(f"layer {layer}: aux {ours:.8f} vs HF {ref:.8f}; tokens per expert max {counts.max()}")
        assert abs(ours - ref) <= 1e-6 * max(1.0, abs(ref))
        assert got[f"moe/layer_{layer:02d}/tokens_per_expert_max"] == float(counts.max())
        assert got[f"moe/layer_{layer:02d}/tokens_per_expert_min"] == float(counts.min())
    assert "moe/layer_01/aux_loss" not in got and got["moe/aux_loss"] > 0
    assert abs(padded["moe/layer_00/aux_loss"] - got["moe/layer_00/aux_loss"]) > 1e-4


@pytest.mark.parametrize("case", ["tp_without_sp", "ep_not_dividing", "dispatcher"])
def test_moe_layout_errors_are_one_line(tiny_dirs, tmp_path, case):
    from mgrpo.config import ConfigError, load_config
    from mgrpo.layout_checks import validate_layout
    from mgrpo.models.hf_config import read_model_info

    model = tiny_dirs("qwen3_moe", **CASES["qwen3_moe"])
    args, world = {
        "tp_without_sp": (["--tp", "2"], 2),
        "ep_not_dividing": (["--ep", "3"], 3),
        "dispatcher": (["--model.moe.token_dispatcher", "flex"], 1),
    }[case]
    expect = {
        "tp_without_sp": "megatron requires sequence parallelism with MoE and TP; add --sp",
        "ep_not_dividing": "parallel.ep=3 does not divide num_experts=8",
        "dispatcher": "model.moe.token_dispatcher='flex': use auto, alltoall or allgather",
    }[case]
    cfg = load_config(argv=["--model.path", model, "--data.path", "x.jsonl", *args], check_files=False)
    errors = validate_layout(cfg, read_model_info(model), world, cuda=False)
    assert any(expect in e for e in errors), errors
    del ConfigError


def test_tiny_moe_task_learns_at_ep2(tmp_path):
    """examples/tiny_moe_cpu.yaml under torchrun at EP2 (DP2 x EP2) with routing replay (the HF engine's records
    broadcast with the samples to both ranks): the reward rises, moe/ metrics and the experts panel are logged."""
    import yaml

    from mgrpo.parallel.distributed import free_port

    out = tmp_path / "run"
    with open(os.path.join(ROOT, "examples", "tiny_moe_cpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["path"], cfg["logging"]["output_dir"] = str(tmp_path / "model"), str(out)
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(cfg))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        "launch/train_grpo.py",
        "--config",
        str(tmp_path / "moe.yaml"),
        "--ep",
        "2",
        "--algorithm.routing_replay",
        "true",
        "--data.path",
        os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl"),
        "--train.steps",
        "16",  # of the example's 30: reward 0.07 -> 0.67 by step 16 (first 5 vs last 5), the bar is +0.2
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rewards = [x["reward/mean"] for x in rows if "reward/mean" in x]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"tiny MoE at EP2: reward first5 {first:.4f} last5 {last:.4f}; last moe/aux_loss {rows[-1]['moe/aux_loss']}")
    assert last >= first + 0.2
    assert all(f"moe/layer_{i:02d}/tokens_per_expert_cv" in rows[0] for i in range(4))
    assert all(r["moe/router_agreement"] > 0.99 for r in rows)  # fp32 engine and trainer: the same experts
    from mgrpo.report import panels

    assert any(title.startswith("Experts (MoE)") for title, _ in panels(rows[0].keys()))
    assert (out / "report.png").stat().st_size > 10_000
