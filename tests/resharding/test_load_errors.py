"""load_hf names the tensor or file at fault: a missing tensor, or a config.json that does not match the weights."""
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mgrpo.models.builder import build_model
from mgrpo.resharding.load import CheckpointError, load_hf


def test_missing_tensor(single_rank, tiny_dirs, tmp_path):
    src = tiny_dirs("load_err", family="qwen2", num_layers=2)
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    chunks = build_model(str(bad), single_rank)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.down_proj.weight' not found"):
        load_hf(chunks, str(bad))


def test_config_does_not_match_weights(single_rank, tiny_dirs, tmp_path):
    src = tiny_dirs("load_err", family="qwen2", num_layers=2)
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 512  # the weights have 256
    (bad / "config.json").write_text(json.dumps(cfg))
    chunks = build_model(str(bad), single_rank)
    with pytest.raises(CheckpointError, match="config.json does not match the weights"):
        load_hf(chunks, str(bad))
    assert os.path.isfile(bad / "model.safetensors")
