"""Export by direct sends (`weights/direct_export.py`): mapping specs survive JSON, and in one torchrun launch
(world 4) the direct path equals the source safetensors and the gather path bitwise at TP2xPP2 (destination rank 3:
stage 1's TP1, outside stage 0) and at TP2xDP2 with one destination per replica."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from mgrpo.weights.direct_export import mapping_of, spec_of, supported
from mgrpo.weights.mappings import QKV, Column, Expert, GatedMLP, Replicated, Row, Vocab

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIASED = dict(family="llama", vocab_size=300, num_layers=2, attention_bias=True, mlp_bias=True, seed=5)
N_TENSORS = 3 + 2 * (2 + 8 + 6)


def test_mapping_specs_survive_json():
    for m in (
        Replicated(("a",)),
        Column(("b",)),
        Row(("c",)),
        GatedMLP(("g", "u")),
        Vocab(("e",), vocab_size=300, padded_size=384),
        QKV(("q", "k", "v"), num_heads=4, num_groups=2, head_dim=8),
    ):
        back = mapping_of(json.loads(json.dumps(spec_of(m))))
        assert type(back) is type(m) and back == m, (m, back)
    expert = Expert((), of=lambda e: Row((f"x{e}",)))
    assert not supported([(None, expert)]) and supported([(None, Row(("c",)))])


@pytest.fixture(scope="module")
def launched(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("direct_export")
    model = str(root / "model")
    shutil.copytree(tiny_dirs("biased_llama", **BIASED), model)
    from mgrpo.parallel.distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        f"--master-port={free_port()}",
        os.path.join(HERE, "direct_worker.py"),
        "--model",
        model,
        "--out",
        str(root),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"workers failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return [json.loads((root / f"rank{i}.json").read_text()) for i in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,rank", [("tp2-pp2", 3), ("tp2-dp2", 0), ("tp2-dp2", 2)])
def test_direct_export_equals_source_and_gathers(launched, layout, rank):
    r = launched[rank][layout]
    assert r["names"] == N_TENSORS and r["mismatched"] == [] and r["extra"] == [], r
    assert r["differs_from_gather"] == [], r


@pytest.mark.slow
def test_only_destinations_receive(launched):
    assert all(launched[rank]["tp2-pp2"] == {"received": 0} for rank in (0, 1, 2))
    assert all(launched[rank]["tp2-dp2"] == {"received": 0} for rank in (1, 3))
