"""Resharding out: bitwise HF round trips at every layout, a megatron-initialised export that HF loads with
the same logits, a memory bound on streaming export, and the checkpoint -> HF converter."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from layout_check import load_layout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "launch"))


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "pp2-vpp2", "tp2-pp2"])
def test_hf_megatron_hf_round_trip_is_bitwise(layout_results, layout):
    with open(os.path.join(layout_results, f"roundtrip-{layout}.roundtrip.json")) as f:
        r = json.load(f)
    assert r["mismatched"] == [] and r["extra"] == [], r
    assert r["names"] == 3 + 4 * 12
    assert r["embed_rows"][0] == 300 and r["lm_head_rows"][0] == 300, "vocabulary padding leaked"


def test_megatron_initialised_export_loads_in_hf(layout_results):
    from transformers import AutoModelForCausalLM

    ours = torch.load(os.path.join(layout_results, "initexport-tp2-pp2.logits.pt"), weights_only=True)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.join(layout_results, "initexport-tp2-pp2.hf"), dtype=torch.float32
    )
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        theirs = hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"megatron-init TP2xPP2 export: max |megatron - HF| logit = {diff:.2e}")
    assert diff <= 1e-5


def test_streaming_export_memory_is_bounded():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "export_memory_probe.py"), "32"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    bound = m["bucket_mb"] + m["largest_mb"] + 64
    print(
        f"model {m['model_mb']:.0f} MB: streamed +{m['streamed_increase_mb']:.0f} MB, "
        f"list() +{m['list_increase_mb']:.0f} MB, bound {bound:.0f} MB"
    )
    assert m["model_mb"] >= 400
    assert m["streamed_increase_mb"] <= bound
    assert m["list_increase_mb"] > bound, "holding every tensor must break the bound, or the check is blind"


def _ckpt(layout_results):
    return os.path.join(layout_results, "ckpt-ckpt:tp2-pp2", "step_000001")


def test_converter_output_matches_source_model(layout_results, tmp_path):
    from convert_to_hf import main
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert main(["--checkpoint", _ckpt(layout_results), "--output", str(out), "--max-shard-size", "300KB"]) == 0
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "generation_config.json" in files
    assert "tokenizer.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    source = load_layout(layout_results, "tp2-pp2")["weights"]  # what TP2xPP2 exported after the same step
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    reference.load_state_dict(source, strict=True)
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (converted(ids).logits - reference(ids).logits).abs().max().item()
    print(f"converter: max |converted - source| logit = {diff:.2e}")
    assert diff <= 1e-6
    bf16 = tmp_path / "hf16"
    assert main(["--checkpoint", _ckpt(layout_results), "--output", str(bf16), "--dtype", "bfloat16"]) == 0
    with open(bf16 / "config.json") as f:
        cfg = json.load(f)
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_converter_errors(layout_results, tmp_path, capsys):
    from convert_to_hf import main

    def one_line(code, expect):
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
        assert code == 2 and len(err) == 1 and expect in err[0], err

    one_line(
        main(["--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")]), "checkpoint folder not found"
    )
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    one_line(main(["--checkpoint", _ckpt(layout_results), "--output", str(busy)]), "pass --overwrite")
    assert (busy / "x").read_text() == "keep"
    broken = tmp_path / "broken"
    shutil.copytree(_ckpt(layout_results), broken)
    shard = next(os.path.join(broken, "dist", f) for f in sorted(os.listdir(broken / "dist")) if f.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    one_line(main(["--checkpoint", str(broken), "--output", str(tmp_path / "o3")]), "truncated, damaged or missing")
    assert not (tmp_path / "o3").exists(), "nothing half-written"
