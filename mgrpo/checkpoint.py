"""mgrpo checkpoints: megatron dist_checkpointing state (any layout can load any other) plus what a
converter needs to rebuild the HF model without the original folder.

    step_000010/
      dist/              megatron dist_checkpointing files of the model chunks
      hf/                the source config.json, generation_config.json and tokenizer files
      mgrpo_meta.json    {"mgrpo_version", "step", "layout": {tp, pp, vpp, cp, ep}, "params_dtype", "family"}

The folder is written as step_XXXXXX.tmp and renamed when every rank has finished; an existing folder of the same
step is renamed aside before and deleted after (`mgrpo.fsutil.replace_dir`), so a kill never leaves neither.
"""
from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

import mgrpo
from mgrpo.fsutil import replace_dir
from mgrpo.parallel.pipeline import unwrap
from mgrpo.resharding.hf_writer import COPIED

META = "mgrpo_meta.json"


class CheckpointFolderError(ValueError):
    """A checkpoint folder that is missing, incomplete or damaged; the message names the path."""


def sharded_state(model_chunks) -> dict:
    return {f"model{i}": unwrap(c).sharded_state_dict(prefix="") for i, c in enumerate(model_chunks)}


def save_checkpoint(model_chunks, cfg, step: int, save_root: str, src_hf_dir: str) -> str:
    from megatron.core import dist_checkpointing

    final = os.path.join(save_root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "dist"))
        os.makedirs(os.path.join(tmp, "hf"))
    dist.barrier()
    dist_checkpointing.save(sharded_state(model_chunks), os.path.join(tmp, "dist"))
    if dist.get_rank() == 0:
        for fname in COPIED:
            if os.path.isfile(os.path.join(src_hf_dir, fname)):
                shutil.copy(os.path.join(src_hf_dir, fname), os.path.join(tmp, "hf", fname))
        p = cfg.parallel
        meta = {"mgrpo_version": mgrpo.__version__, "step": step, "params_dtype": cfg.model.params_dtype,
                "family": unwrap(model_chunks[0]).mgrpo_info.family,
                "layout": {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep}}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=2)
        replace_dir(tmp, final)
    dist.barrier()
    return final


def read_meta(ckpt_dir: str) -> dict:
    if not os.path.isdir(ckpt_dir):
        raise CheckpointFolderError(f"{ckpt_dir}: checkpoint folder not found")
    for need in (META, "dist", os.path.join("hf", "config.json")):
        if not os.path.exists(os.path.join(ckpt_dir, need)):
            raise CheckpointFolderError(f"{ckpt_dir}: not an mgrpo checkpoint ({need} is missing); point at a "
                                        f"step_XXXXXX folder written by the trainer")
    with open(os.path.join(ckpt_dir, META)) as f:
        return json.load(f)


def load_checkpoint(model_chunks, ckpt_dir: str) -> dict:
    """Load model weights saved at any layout into these chunks; returns the metadata."""
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir)
    try:
        state = dist_checkpointing.load(sharded_state(model_chunks), os.path.join(ckpt_dir, "dist"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointFolderError(f"{ckpt_dir}/dist: cannot load ({type(exc).__name__}: {first}); "
                                    f"a checkpoint file is truncated, damaged or missing") from None
    for i, chunk in enumerate(model_chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointFolderError(f"{ckpt_dir}: tensors missing from the checkpoint: {missing[:5]}")
    return meta
