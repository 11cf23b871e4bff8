"""The layout matrix: loss, every HF-named gradient, and the weights after one optimizer step equal the
TP1 run's at TP2, TP2+SP, PP2, PP2xVPP2, DP2 (plain and distributed optimizer), TP2xPP2 and TP2xPP2xDP2.

A fixed global batch of 8 samples with unequal lengths goes through 4 micro-batches on every rank; old
logprobs are the TP1 model's plus noise, so PPO ratios leave the clip range and both branches are exercised.
"""
import os
import subprocess
import sys

import pytest
import torch

from mgrpo.config import load_config
from mgrpo.parallel.distributed import free_port
from mgrpo.parallel.layout_check import load_layout, run_layout
from mgrpo.rollout.types import Sample, samples_to_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ABS, REL, REL_FLOOR = 1e-5, 1e-4, 1e-3  # rel = |diff| / max(|ref|, REL_FLOOR)

LAUNCHES = {
    2: ["tp2", "tp2-sp", "pp2", "pp2-vpp2", "dp2", "dp2-distopt", "tp2-wrongshard"],
    4: ["tp2-pp2", "tp2-pp2-vpp2-sp"],
    8: ["tp2-pp2-dp2", "tp2-pp2-dp2-distopt"],
}


def make_samples(model_dir):
    """8 samples, prompts of 5..19 and responses of 3..27 tokens, old logprobs = TP1 logprobs + noise."""
    from mgrpo.actor import Actor
    from mgrpo.data.microbatch import make_microbatches

    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(8):
        p, r = 5 + (i * 5) % 15, 3 + (i * 7) % 25
        resp = torch.randint(3, 300, (r,), generator=g).tolist()
        mask = [1] * r
        if i % 3 == 0:
            mask[r // 2] = 0  # an environment-written token inside the response
        samples.append(Sample(prompt_ids=torch.randint(3, 300, (p,), generator=g).tolist(), response_ids=resp,
                              loss_mask=mask, group_id=i // 4,
                              info={"advantage": float(torch.randn((), generator=g))}))
    cfg = load_config(argv=["--model.path", model_dir, "--data.path", "unused.jsonl"], check_files=False)
    actor = Actor(cfg, model_dir, train=False)
    for s in samples:
        mb = make_microbatches([s], 1, 0)[0]
        logp = actor.logprobs([mb])[0][0]
        pos = [len(s.prompt_ids) + j - 1 for j in range(len(s.response_ids))]
        noise = 0.3 * torch.randn(len(pos), generator=g)
        s.rollout_logprobs = (logp[pos] + noise).tolist()
    return samples


@pytest.fixture(scope="module")
def layout_results(single_rank, tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    model = tiny_dirs("layout_qwen2", family="qwen2", vocab_size=300, num_layers=4, seed=3)
    samples = make_samples(model)
    path = out / "samples.json"
    path.write_bytes(samples_to_bytes(samples))
    ref_cfg = load_config(argv=["--model.path", model, "--data.path", str(path), "--train.lr", "0.01",
                                "--train.adam_eps", "0.001", "--train.micro_batch_size", "2"])
    run_layout(ref_cfg, model, samples, str(out), "tp1")
    logs = {}
    for world, layouts in LAUNCHES.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", os.path.join(HERE, "layout_worker.py"), "--model", model,
               "--samples", str(path), "--out", str(out), "--layouts", ",".join(layouts)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        logs[world] = r
        assert r.returncode == 0, f"world {world} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return str(out)


def compare(ref: dict, got: dict, what: str) -> float:
    assert ref.keys() == got.keys(), f"{what}: names differ: {sorted(ref.keys() ^ got.keys())[:5]}"
    worst = 0.0
    for name in ref:
        a, b = got[name].double(), ref[name].double()
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        diff = (a - b).abs()
        rel = diff / b.abs().clamp_min(REL_FLOOR)
        assert diff.max() <= ABS and rel.max() <= REL, \
            f"{what} {name}: max abs {diff.max():.2e} rel {rel.max():.2e} (tol {ABS}, {REL})"
        worst = max(worst, float(diff.max()))
    return worst


def check(out, tag):
    ref, got = load_layout(out, "tp1"), load_layout(out, tag)
    assert abs(got["loss"] - ref["loss"]) <= ABS, f"loss {got['loss']} vs {ref['loss']}"
    g = compare(ref["grads"], got["grads"], "grad") if got["grads"] else None
    w = compare(ref["weights"], got["weights"], "weight after step")
    print(f"{tag}: loss {got['loss']:.8f} (tp1 {ref['loss']:.8f}) max grad diff {g} max weight diff {w:.2e}")


@pytest.mark.parametrize("tag", [t for ts in LAUNCHES.values() for t in ts if "wrong" not in t])
def test_layout_matches_tp1(layout_results, tag):
    check(layout_results, tag)


def test_wrong_shard_is_detected(layout_results):
    with pytest.raises(AssertionError):
        check(layout_results, "tp2-wrongshard")


def test_reference_has_gradients(layout_results):
    ref = load_layout(layout_results, "tp1")
    assert len(ref["grads"]) == 3 + 4 * 12  # embed, norm, lm_head; per layer 2 norms, q/k/v w+b, o, gate, up, down
    assert all(g.abs().sum() > 0 for n, g in ref["grads"].items()), "every parameter gets a gradient"
