"""A Llama with every bias HF can give it (attention_bias and mlp_bias): the o_proj / gate / up / down biases
survive HF -> megatron -> export_hf bitwise at TP1, TP2 and PP2, and TP2 logits equal HF's."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIASED = dict(family="llama", vocab_size=300, num_layers=2, attention_bias=True, mlp_bias=True, seed=5)
# embed, final norm, lm_head + per layer: 2 norms, q/k/v/o weights and biases, gate/up/down weights and biases
N_TENSORS = 3 + 2 * (2 + 8 + 6)
EXTRA = "model.layers.1.mlp.extra.weight"


def _round_trip_tp1(model, parallel):
    from mgrpo.models.builder import build_model
    from mgrpo.weights.export import export_hf
    from mgrpo.weights.load import SafetensorsReader, load_hf

    chunks = build_model(model, parallel)
    load_hf(chunks, model)
    got = {name: t.clone() for name, t in export_hf(chunks, dst=0, bucket_bytes=64 << 10)}
    reader = SafetensorsReader(model)
    mismatched = [n for n in reader.where if n not in got or not torch.equal(got[n], reader.read(n))]
    return {"names": len(got), "mismatched": mismatched, "extra": sorted(set(got) - set(reader.where))}


def _check(r):
    assert r["mismatched"] == [] and r["extra"] == [] and r["names"] == N_TENSORS, r


def test_biased_llama_round_trip_tp1_is_bitwise(single_rank, tiny_dirs):
    model = tiny_dirs("biased_llama", **BIASED)
    assert any(n.endswith("o_proj.bias") for n in load_file(os.path.join(model, "model.safetensors")))
    _check(_round_trip_tp1(model, single_rank))


@pytest.fixture(scope="module")
def launched(tiny_dirs, tmp_path_factory):
    """One torchrun launch (world 2) running TP2 then PP2; returns (model folder, rank-0 results, rank-1 results)."""
    root = tmp_path_factory.mktemp("bias_export")
    model = str(root / "model")
    shutil.copytree(tiny_dirs("biased_llama", **BIASED), model)
    torch.save(torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3)), root / "ids.pt")
    bad = root / "bad"
    shutil.copytree(model, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors[EXTRA] = torch.zeros(4)
    save_file(tensors, str(bad / "model.safetensors"))
    from mgrpo.parallel.distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        os.path.join(HERE, "bias_worker.py"),
        "--model",
        model,
        "--bad",
        str(bad),
        "--out",
        str(root),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"workers failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return model, [json.loads((root / f"rank{i}.json").read_text()) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_biased_llama_round_trip_is_bitwise(launched, layout):
    _check(launched[1][0][layout])


@pytest.mark.slow
def test_biased_llama_tp2_logits_equal_hf(launched):
    from transformers import AutoModelForCausalLM

    model = launched[0]
    ours = torch.load(model + ".tp2.logits.pt", weights_only=True)
    ids = torch.load(os.path.join(os.path.dirname(model), "ids.pt"), weights_only=True)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (ours - hf(ids).logits).abs().max().item()
    print(f"biased llama TP2: max |megatron - HF| logit = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_unconsumed_tensor_of_another_stage_fails_on_every_rank(launched):
    """At PP2 the extra layer-1 tensor lies in stage 1's layers, yet stage 0 must refuse the folder too."""
    for rank, res in enumerate(launched[1]):
        msg = res["pp2_unconsumed"]
        assert f"'{EXTRA}'" in msg and "1 checkpoint tensor(s)" in msg, (rank, msg)
