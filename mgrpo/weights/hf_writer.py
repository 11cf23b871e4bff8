"""Write an HF model folder from a stream of (name, tensor): safetensors shards of a max size, the index,
config.json, generation_config.json and tokenizer files copied from the source folder.

Writes into a temporary sibling folder and renames it into place (the old folder aside first, deleted last), so a
crash never leaves a half folder, nor no folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from mgrpo.fsutil import replace_dir

COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OutputExistsError(ValueError):
    pass


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        if not overwrite:
            raise OutputExistsError(
                f"{out_dir}: output folder exists and is not empty; pass --overwrite to "
                f"replace it or choose another folder"
            )


def write_hf_folder(
    named_tensors,
    out_dir: str,
    src_hf_dir: str,
    max_shard_bytes: int = 5 << 30,
    dtype: str | None = None,
    overwrite: bool = False,
    progress=None,
) -> dict:
    """Stream tensors into shards; returns the index dict. `dtype` casts floating tensors (and config.json)."""
    from safetensors.torch import save_file

    check_output_dir(out_dir, overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf-export-", dir=parent)
    try:
        weight_map, shard, size, files, total = {}, {}, 0, [], 0

        def flush():
            nonlocal shard, size
            if shard:
                name = f"model-{len(files) + 1:05d}.safetensors"
                save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
                files.append(name)
                for k in shard:
                    weight_map[k] = name
                shard, size = {}, 0

        for name, t in named_tensors:
            t = t.detach()
            if progress is not None:
                progress.update(t.numel() * t.element_size())
            if dtype and t.is_floating_point():
                t = t.to(_DTYPES[dtype])
            n = t.numel() * t.element_size()
            if shard and size + n > max_shard_bytes:
                flush()
            # a host copy (contiguous, never aliasing a buffer the caller reuses): on a GPU the shard must not
            # collect on the device (up to max_shard_bytes beside the trainer's state)
            shard[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
            size += n
            total += n
        flush()
        renamed = {}
        for i, f in enumerate(files):  # final names carry the shard count, as HF's do
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(os.path.join(tmp, f), os.path.join(tmp, final))
            renamed[f] = final
        index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
        for fname in COPIED:
            src = os.path.join(src_hf_dir, fname)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(tmp, fname))
        if dtype:
            cfg_path = os.path.join(tmp, "config.json")
            with open(cfg_path) as fh:
                cfg = json.load(fh)
            cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] = dtype
            with open(cfg_path, "w") as fh:
                json.dump(cfg, fh, indent=2)
        replace_dir(tmp, out_dir)
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_peft_folder(named_tensors, out_dir: str, adapter_config: dict, overwrite: bool = False) -> str:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) from (PEFT name, tensor) pairs,
    written to a temporary folder beside `out_dir` and renamed into place."""
    from safetensors.torch import save_file

    check_output_dir(out_dir, overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".peft-", dir=parent)
    try:
        save_file(
            {n: t.detach().contiguous().cpu() for n, t in named_tensors}, os.path.join(tmp, "adapter_model.safetensors")
        )
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f, indent=2)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
