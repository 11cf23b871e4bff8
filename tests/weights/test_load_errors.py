"""load_hf names the tensor or file at fault: a missing tensor, a config.json that does not match the weights,
or a checkpoint tensor nothing reads (which would otherwise be dropped silently)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mgrpo.models.builder import build_model
from mgrpo.weights.load import CheckpointError, load_hf


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


def _one_line_error(chunks, path):
    with pytest.raises(CheckpointError) as err:
        load_hf(chunks, path)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_unconsumed_tensor_is_named(single_rank, tiny_dirs, tmp_path):
    """A tensor no mapping reads used to be skipped without a word."""
    src = tiny_dirs("load_err", family="qwen2", num_layers=2)
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(4)
    save_file(tensors, str(bad / "model.safetensors"))
    msg = _one_line_error(build_model(str(bad), single_rank), str(bad))
    assert "1 checkpoint tensor(s) read by no parameter" in msg and "'model.layers.0.mlp.extra.weight'" in msg, msg
    assert "fix config.json" in msg


def test_biases_the_config_does_not_declare(single_rank, tiny_dirs, tmp_path):
    """A biased Llama whose config.json lost attention_bias: the 8 q/k/v/o biases are named, not dropped."""
    src = tiny_dirs("load_err_llama_bias", family="llama", num_layers=2, attention_bias=True)
    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["attention_bias"] = False
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = _one_line_error(build_model(str(bad), single_rank), str(bad))
    assert "8 checkpoint tensor(s)" in msg and "'model.layers.0.self_attn.k_proj.bias'" in msg, msg
    assert "(+5 more)" in msg and "attention_bias" in msg, msg


def test_tensors_hf_ignores_are_tolerated(single_rank, tiny_dirs, tmp_path):
    """Old saves carry rotary inv_freq buffers, and tied models sometimes an lm_head copy: HF skips both."""
    src = tiny_dirs("load_err_tied", family="qwen2", num_layers=2, tie_word_embeddings=True)
    ok = tmp_path / "m"
    shutil.copytree(src, ok)
    tensors = load_file(str(ok / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, str(ok / "model.safetensors"))
    load_hf(build_model(str(ok), single_rank), str(ok))


def test_consumed_names_cover_layers_on_other_stages(single_rank, tiny_dirs):
    """Under PP a rank holds some layers only; the consumed set must still be the whole model's."""
    from types import SimpleNamespace

    from mgrpo.weights.load import SafetensorsReader
    from mgrpo.weights.name_map import consumed_hf_names

    src = tiny_dirs("load_err_llama_bias", family="llama", num_layers=2, attention_bias=True)
    chunk = build_model(src, single_rank)[0]
    last_stage = SimpleNamespace(
        mgrpo_info=chunk.mgrpo_info,  # like PP rank 1 of 2: global layer 2 only
        decoder=SimpleNamespace(layers=[chunk.decoder.layers[1]]),
    )
    assert consumed_hf_names([last_stage]) == set(SafetensorsReader(src).where) == consumed_hf_names([chunk])
