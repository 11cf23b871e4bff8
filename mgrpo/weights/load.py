"""HF safetensors -> this rank's megatron shards, reading only the slices each rank owns."""

from __future__ import annotations

import fnmatch
import json
import os

import torch

from mgrpo.weights.mappings import TensorReader
from mgrpo.weights.name_map import chunk_mappings, consumed_hf_names

# Checkpoint tensors HF itself skips when loading (old Llama/Qwen2 saves kept rotary buffers).
_HF_IGNORED = ("*.rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A missing or damaged HF checkpoint file or tensor; the message names it."""


class SafetensorsReader(TensorReader):
    """Slices of tensors from an HF folder (single file or sharded with model.safetensors.index.json)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            self.where = None
        else:
            raise CheckpointError(
                f"{hf_dir}: no model.safetensors or model.safetensors.index.json; "
                f"model.path must be an HF folder saved with safetensors"
            )
        self._open = {}
        self._safe_open = safe_open
        if self.where is None:
            self.where = {k: "model.safetensors" for k in self._file("model.safetensors").keys()}

    def _file(self, fname: str):
        if fname not in self._open:
            path = os.path.join(self.hf_dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{path}: checkpoint shard is missing (listed in the index); re-download or re-convert the model"
                )
            try:
                self._open[fname] = self._safe_open(path, framework="pt")
            except Exception as exc:  # truncated or corrupt header
                raise CheckpointError(f"{path}: cannot read safetensors file ({exc}); the shard is damaged") from None
        return self._open[fname]

    def has(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name):
        if name not in self.where:
            raise CheckpointError(
                f"{self.hf_dir}: tensor {name!r} not found in the checkpoint; the checkpoint "
                f"does not match config.json (wrong architecture or missing shard)"
            )
        return self._file(self.where[name]).get_slice(name)

    def shape(self, name):
        return tuple(self._slice(name).get_shape())

    def read(self, name, rows=None, cols=None):
        sl = self._slice(name)
        try:
            if cols is not None:
                t = sl[rows if rows is not None else slice(None), cols]
            elif rows is not None:
                t = sl[rows]
            else:
                t = sl[:]
        except Exception as exc:
            raise CheckpointError(
                f"{self.hf_dir}/{self.where[name]}: reading {name!r} failed ({exc}); the shard is truncated or damaged"
            ) from None
        return t.contiguous()


def check_all_consumed(model_chunks: list, reader: SafetensorsReader) -> None:
    """Fail if the checkpoint holds a tensor no parameter of the whole model reads.

    Such a tensor (a bias or layer config.json does not declare) would otherwise be dropped silently and the
    model would compute something else than HF does with the same folder. Judged against every PP stage's
    names, so all ranks agree. A tied lm_head.weight and rotary buffers are ignored by HF too.
    """
    info = model_chunks[0].mgrpo_info
    used = consumed_hf_names(model_chunks)
    if info.tie_word_embeddings:
        used.add("lm_head.weight")
    unused = sorted(
        n for n in reader.where if n not in used and not any(fnmatch.fnmatchcase(n, pat) for pat in _HF_IGNORED)
    )
    if unused:
        shown = ", ".join(repr(n) for n in unused[:3]) + (f" (+{len(unused) - 3} more)" if len(unused) > 3 else "")
        raise CheckpointError(
            f"{reader.hf_dir}: {len(unused)} checkpoint tensor(s) read by no parameter of the "
            f"{info.family} model that config.json describes: {shown}; rather than drop them "
            f"silently, fix config.json (e.g. attention_bias, mlp_bias, num_hidden_layers) or "
            f"remove them from the checkpoint"
        )


def load_hf(model_chunks: list, hf_dir: str) -> None:
    """Fill every chunk's parameters from the HF folder (each rank reads only its own slices).

    First checks that nothing in the checkpoint goes unread (see `check_all_consumed`)."""
    from megatron.core import parallel_state as mpu

    reader = SafetensorsReader(hf_dir)
    check_all_consumed(model_chunks, reader)
    rank, size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    etp = mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    for chunk in model_chunks:
        for name, param, mapping in chunk_mappings(chunk):  # an expert reads only its own expert's slices
            if mapping.hf_names == ("lm_head.weight",) and not reader.has("lm_head.weight"):
                raise CheckpointError(
                    f"{hf_dir}: 'lm_head.weight' missing but tie_word_embeddings is false; "
                    f"set tie_word_embeddings=true in config.json or add the tensor"
                )
            try:
                shard = mapping.shard(reader, *(etp if mapping.expert else (rank, size)))
            except CheckpointError:
                raise
            except ValueError as exc:
                raise CheckpointError(f"{hf_dir}: {exc}") from None
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{hf_dir}: {mapping.hf_names} gives shape {tuple(shard.shape)} for megatron "
                    f"{name} of shape {tuple(param.shape)}; config.json does not match the weights"
                )
            with torch.no_grad():
                param.copy_(shard.to(param.dtype))
