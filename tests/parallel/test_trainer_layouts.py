"""GRPOTrainer.step itself at DP2, CP2 and TP2xPP2xDP2 equals TP1: one generation batch with a fixed seed (two
mini-batches, so the second update sees ratios != 1), every optimizer step's loss and grad norm, and the weights
the engine holds after the step (<= 1e-5). Configurations: (a) k3 KL loss term + entropy bonus + token TIS;
(b) KL in the reward. Only the first generation batch is compared (later ones may part at sampling near-ties)."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "trainer_worker.py")
LAUNCHES = {2: ["dp2:a", "dp2:b", "cp2:a", "cp2:b"], 8: ["tp2-pp2-dp2:a", "tp2-pp2-dp2:b"]}
ABS, REL, REL_FLOOR = 1e-5, 1e-4, 1e-3


@pytest.fixture(scope="module")
def results(single_rank, tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    out = tmp_path_factory.mktemp("trainer_layouts")
    model = tiny_dirs("trainer_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    sys.path.insert(0, HERE)
    from trainer_worker import run

    for name in ("a", "b"):  # TP1 references in this process
        run(model, str(out), "tp1", name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    for world, runs in LAUNCHES.items():
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            WORKER,
            "--model",
            model,
            "--out",
            str(out),
            "--runs",
            ",".join(runs),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        assert r.returncode == 0, f"world {world}:\n{r.stderr[-5000:]}"
    return str(out)


def _load(out, tag):
    return json.load(open(os.path.join(out, f"{tag}.json"))), torch.load(os.path.join(out, f"{tag}.pt"))


def _close(a, b):
    return abs(a - b) <= ABS + REL * max(abs(b), REL_FLOOR)


@pytest.mark.parametrize("tag", [r.replace(":", "-") for runs in LAUNCHES.values() for r in runs])
def test_trainer_step_matches_tp1(results, tag):
    name = tag.rsplit("-", 1)[1]
    got, got_w = _load(results, tag)
    ref, ref_w = _load(results, f"tp1-{name}")
    assert len(got["updates"]) == len(ref["updates"]) == 2
    for u, (g, r) in enumerate(zip(got["updates"], ref["updates"])):
        for key in ("actor/loss", "actor/grad_norm", "actor/kl_old", "actor/clip_frac"):
            assert _close(g[key], r[key]), f"update {u} {key}: {g[key]} vs tp1 {r[key]}"
    assert ref["updates"][1]["actor/kl_old"] > 0, "the second update must see ratios != 1"
    worst = max(float((got_w[n] - ref_w[n]).abs().max()) for n in ref_w)
    moved = max(float((ref_w[n]).abs().max()) for n in ref_w)
    print(
        f"{tag}: losses {[u['actor/loss'] for u in got['updates']]} vs tp1 "
        f"{[u['actor/loss'] for u in ref['updates']]}, max weight diff {worst:.2e}"
    )
    assert worst <= ABS and moved > 0
    assert _close(got["reward"], ref["reward"])
