"""write_hf_folder: shards hold host copies of what the stream yielded at the time, whatever the stream does with
its buffers afterwards (a bucket reused for the next tensors), non-contiguous views included."""

import json
import os

import torch
from safetensors.torch import load_file

from mgrpo.weights.hf_writer import write_hf_folder


def test_shards_hold_copies_of_reused_buffers_and_transposed_views(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    buffer = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    want = {}

    def stream():
        for i in range(3):
            buffer.add_(100)  # the same storage, new values, for every tensor
            name = f"layer.{i}.weight"
            view = buffer.t() if i == 1 else buffer[1:]
            want[name] = view.clone()
            yield name, view

    index = write_hf_folder(stream(), str(tmp_path / "out"), str(src), max_shard_bytes=64)
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(os.path.join(tmp_path, "out", f)))
    assert got.keys() == want.keys() and len(set(index["weight_map"].values())) == 3
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert got["layer.1.weight"].shape == (4, 3)
