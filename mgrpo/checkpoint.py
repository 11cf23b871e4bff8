"""mgrpo checkpoints: the whole training state on megatron dist_checkpointing (any layout loads any other).

    SAVE_DIR/
      latest               "step_000010": rewritten by rename, only after that folder is complete
      step_000010/
        dist/              dist_checkpointing: model chunks, optimizer state (plain or distributed), RNG per rank,
                           and the common state (step, weight version, data position, LR scheduler, skipped steps)
        hf/                the source config.json, generation_config.json and tokenizer files
        config.yaml        the resolved config of the run that saved it
        mgrpo_meta.json    step, layout, dtype, family, the same common state as JSON, and every file's size
      hf_step_000010/      with checkpoint.export_hf_at_end: the converter's HF folder for the last step

A save writes step_XXXXXX.tmp; when every rank has finished, rank 0 records the file sizes, renames the folder
into place, rewrites `latest`, and only then prunes to `keep_last`. A kill at any instant leaves `latest` on a
complete checkpoint; a leftover .tmp is never read, and the next save of that step replaces it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml

import mgrpo
from mgrpo.fsutil import replace_dir
from mgrpo.parallel.pipeline import unwrap
from mgrpo.profiling import PeakRSS
from mgrpo.weights.hf_writer import COPIED

META = "mgrpo_meta.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
OPTIMIZER_FORMATS = {False: "dp_reshardable", True: "fully_reshardable"}  # checkpoint.reshardable -> megatron's


class CheckpointFolderError(ValueError):
    """A checkpoint folder that is missing, incomplete, damaged or of another model; the message names the path."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _file_sizes(folder: str) -> dict:
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            if name != META:
                out[os.path.relpath(path, folder)] = os.path.getsize(path)
    return out


def read_meta(ckpt_dir: str, verify: bool = True) -> dict:
    """The folder's metadata, after checking that every file it lists is there at its recorded size."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointFolderError(f"{ckpt_dir}: checkpoint folder not found")
    for need in (META, "dist", os.path.join("hf", "config.json")):
        if not os.path.exists(os.path.join(ckpt_dir, need)):
            raise CheckpointFolderError(
                f"{ckpt_dir}: not a complete mgrpo checkpoint ({need} is missing); point at "
                f"a step_XXXXXX folder written by the trainer"
            )
    try:
        with open(os.path.join(ckpt_dir, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointFolderError(f"{ckpt_dir}/{META}: unreadable ({exc})") from None
    for rel, size in (meta.get("files") or {}).items() if verify else ():
        path = os.path.join(ckpt_dir, rel)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have != size:
            state = "missing" if have is None else f"{have} bytes, {size} when saved"
            raise CheckpointFolderError(
                f"{path}: {state}: the checkpoint is truncated, damaged or missing a file; use another checkpoint"
            )
    return meta


def resolve(spec: str, save_dir: str) -> str:
    """`--resume` -> the checkpoint folder: "latest" reads SAVE_DIR/latest (never a .tmp), else spec is the folder."""
    if spec != "latest":
        return spec.rstrip("/")
    pointer = os.path.join(save_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            return os.path.join(save_dir, f.read().strip())
    found = complete_checkpoints(save_dir)  # `latest` not written yet: the newest folder with its metadata
    if not found:
        raise CheckpointFolderError(
            f"no checkpoint in checkpoint.save_dir={save_dir} (no `latest` and no "
            f"complete step_XXXXXX folder); drop --resume to start a fresh run"
        )
    return found[-1][1]


def complete_checkpoints(save_dir: str) -> list:
    """[(step, folder)] of renamed (complete) checkpoints, oldest first."""
    out = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, META)):
            out.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(out)


def rng_state() -> dict:
    """This rank's generators, as tensors and numbers (dist_checkpointing reads them back with weights_only)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": [version, torch.tensor(state, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate((s["python"][0], tuple(int(x) for x in s["python"][1].tolist()), s["python"][2]))
    kind, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(s["torch"])
    get_cuda_rng_tracker().set_states(s["tracker"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _layout(cfg, world: int) -> dict:
    p = cfg.parallel
    return {
        "tp": p.tp,
        "pp": p.pp,
        "vpp": p.vpp,
        "cp": p.cp,
        "ep": p.ep,
        "world_size": world,
        "distributed_optimizer": cfg.train.use_distributed_optimizer,
        "optimizer_format": OPTIMIZER_FORMATS[bool(cfg.checkpoint.reshardable)],
    }


def lora_meta(lora) -> dict | None:
    """The adapters a checkpoint holds (the converter rebuilds them before loading); None without LoRA."""
    if not lora.rank:
        return None
    from mgrpo.models.lora import lora_targets

    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": list(lora_targets(lora))}


def model_state(model_chunks) -> dict:
    return {f"model{i}": unwrap(c).sharded_state_dict(prefix="") for i, c in enumerate(model_chunks)}


def training_state(
    actor, common: dict | None, is_loading: bool, with_rng: bool, optimizer_format: str = "dp_reshardable"
) -> dict:
    """The sharded state dict of a training run: models, optimizer (the distributed optimizer's state in megatron's
    `optimizer_format`), this rank's RNG, and the common state."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = model_state(actor.chunks)
    if actor.optimizer is not None and is_loading:
        _allocate_adam_state(actor.optimizer)
        _fix_distopt_state_copy()
    if actor.optimizer is not None:
        metadata = {"distrib_optim_sharding_type": optimizer_format}
        state["optimizer"] = actor.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)
    if common is not None:
        state["common"] = common
    return state


def _fix_distopt_state_copy() -> None:
    """megatron-core 0.16.1 without Apex/TE keeps Adam's `step` in every parameter's state, and its load copies
    every state key from the checkpoint's tensors, which hold no `step`: KeyError. Copy the others as megatron does
    (the checkpoint's tensors may hold more, e.g. dp_reshardable's `padding`); the step is restored from the param
    groups, as before."""
    from megatron.core.optimizer import distrib_optimizer as d

    cls = d.DistributedOptimizer
    if d.HAVE_APEX_OR_TE or getattr(cls, "_mgrpo_fixed", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key in dst:
            if key != "step":
                dst[key].copy_(tensors[key])

    cls._set_main_param_and_optimizer_states, cls._mgrpo_fixed = set_states, True


def _unshare_steps(optimizer) -> None:
    """megatron's DistributedOptimizer (without Apex/TE) restores Adam's step as ONE tensor shared by every
    parameter; torch's Adam then adds 1 per parameter per update, and the bias correction drifts. One each."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _allocate_adam_state(optimizer) -> None:
    """Zero Adam moments where none exist yet: the state the checkpoint's values are loaded into, with exactly the
    keys the optimizer megatron picked keeps per parameter (megatron would allocate them on a CUDA device).

    `exp_avg` and `exp_avg_sq` always (fp32 under TE, the parameter's dtype under torch): megatron's own
    `init_state_fn` and TransformerEngine's FusedAdam (`transformer_engine/pytorch/optimizers/fused_adam.py`,
    v2.4-2.10, state created in `step()`) lay out the same two. `step` only for torch's Adam, which keeps it per parameter; TE's FusedAdam and Apex keep it as an int in
    each param group, and megatron's DistributedOptimizer copies every state key it finds from the checkpoint
    (`_set_main_param_and_optimizer_states`), which holds no `step`: an extra key is a KeyError on every resume
    under TE."""
    from megatron.core.optimizer import distrib_optimizer

    per_param_step = not distrib_optimizer.HAVE_APEX_OR_TE
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    state, dtype = inner.state[p], p.dtype if per_param_step else torch.float32  # TE: fp32
                    state.update(
                        exp_avg=torch.zeros_like(p.data, dtype=dtype), exp_avg_sq=torch.zeros_like(p.data, dtype=dtype)
                    )
                    if per_param_step:
                        state["step"] = torch.zeros((), dtype=torch.float32)


class Saver:
    """Periodic saves of the whole training state (synchronous, or async: mgrpo/checkpoint_writer.py), `latest`,
    pruning."""

    def __init__(self, cfg):
        self.cfg, self.c = cfg, cfg.checkpoint
        self.queue = None
        found = complete_checkpoints(self.c.save_dir) if self.c.save_dir and not self.c.resume else []
        if found and dist.get_rank() == 0:
            print(
                f"mgrpo: warning: checkpoint.save_dir={self.c.save_dir} already holds checkpoints up to step "
                f"{found[-1][0]}; this fresh run replaces them as it goes (--resume continues that run instead)",
                file=sys.stderr,
                flush=True,
            )
        if self.c.async_save:
            from mgrpo.checkpoint_writer import spawned_writer_queue

            self.queue = spawned_writer_queue()

    def due(self, done_steps: int) -> bool:
        return (
            bool(self.c.save_dir)
            and self.c.save_interval > 0
            and (done_steps % self.c.save_interval == 0 or done_steps == self.cfg.train.steps)
        )

    def save(self, actor, step: int, common: dict) -> str:
        from dataclasses import asdict as to_dict  # the config's dataclasses, as mgrpo.config.to_dict does

        from megatron.core import dist_checkpointing

        _forked_results_queue()
        self.wait()  # one save in flight at a time
        actor.current_params()  # DP rank 0 writes every parameter: none may be a step behind (overlap_param_gather)
        root = self.c.save_dir
        final, started = step_dir(root, step), time.time()
        tmp = final + ".tmp"
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed
            os.makedirs(os.path.join(tmp, "dist"))
            os.makedirs(os.path.join(tmp, "hf"))
            for fname in COPIED:
                if os.path.isfile(os.path.join(self.cfg.model.path, fname)):
                    shutil.copy(os.path.join(self.cfg.model.path, fname), os.path.join(tmp, "hf", fname))
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                yaml.safe_dump(to_dict(self.cfg), f, sort_keys=False)
        dist.barrier()
        meta = {
            "mgrpo_version": mgrpo.__version__,
            "step": step,
            "params_dtype": self.cfg.model.params_dtype,
            "family": actor.info.family,
            "layout": _layout(self.cfg, dist.get_world_size()),
            "state": common,
            "lora": lora_meta(self.cfg.model.lora),
        }
        with PeakRSS(0.005) as rss:  # the synchronous part: fully_reshardable's gather, async save's host copy
            state = training_state(actor, common, False, True, meta["layout"]["optimizer_format"])
            request = dist_checkpointing.save(
                state, os.path.join(tmp, "dist"), async_sharded_save=self.queue is not None
            )
        meta["save_peak_host_mib"] = _per_rank(rss.increase_mb)

        def finalize():
            pause_point("save", step)  # test hook: a kill while the shards sit in the .tmp folder
            dist.barrier()
            if dist.get_rank() == 0:
                meta["files"] = _file_sizes(tmp)
                meta["save_seconds"] = round(time.time() - started, 3)  # until complete
                meta["blocking_seconds"] = round(meta.get("blocking_seconds", meta["save_seconds"]), 3)  # the loop's
                _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=2))
                replace_dir(tmp, final)
                _write_atomic(os.path.join(root, LATEST), os.path.basename(final) + "\n")
                self.prune(final)
                size = sum(meta["files"].values())
                wait = f" (the loop waited {meta['blocking_seconds']:.2f} s)" if request is not None else ""
                print(
                    f"mgrpo: checkpoint {final}: {size / 2**20:.1f} MiB in {meta['save_seconds']:.2f} s{wait}",
                    file=sys.stderr,
                    flush=True,
                )
            dist.barrier()

        if request is None:
            finalize()
        else:
            request.add_finalize_fn(finalize)
            self.queue.schedule_async_request(request)
            meta["blocking_seconds"] = time.time() - started
        return final

    def poll(self) -> None:
        """Finish an async save whose shards are written (collective: every rank calls it each step)."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.wait()
            self.queue.close()
            self.queue = None

    def prune(self, newest: str) -> None:
        if self.c.keep_last <= 0:
            return
        found = [path for _, path in complete_checkpoints(self.c.save_dir)]
        for path in found[: -self.c.keep_last]:
            if os.path.abspath(path) != os.path.abspath(newest):
                shutil.rmtree(path, ignore_errors=True)

    def export_hf(self, actor, step: int) -> str | None:
        """checkpoint.export_hf_at_end: the converter's HF folder (SAVE_DIR/hf_step_XXXXXX), written via a tmp."""
        if not self.c.export_hf_at_end:
            return None
        from mgrpo.weights.export import export_hf
        from mgrpo.weights.hf_writer import write_hf_folder

        out = os.path.join(self.c.save_dir, f"hf_step_{step:06d}")
        tensors = export_hf(actor.current_params(), dst=0, bucket_bytes=self.cfg.rollout.update_bucket_mb << 20)
        if dist.get_rank() == 0:
            write_hf_folder(tensors, out, self.cfg.model.path, overwrite=True)
            print(f"mgrpo: HF model for step {step} written to {out}", file=sys.stderr, flush=True)
        else:
            for _ in tensors:
                pass
        dist.barrier()
        return out


def _forked_results_queue() -> None:
    """Without CUDA, give megatron's file writer its results queue from a forked manager: its default is a spawned
    one, which re-imports the launcher (torch, megatron) and added ~6 s to each process's first save on CPU."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not torch.cuda.is_available() and filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def load_training_state(actor, ckpt_dir: str, cfg) -> dict:
    """Restore models, optimizer, RNG (same layout only) into `actor`; returns the common state."""

    meta, started = read_meta(ckpt_dir), time.time()
    saved_format = meta["layout"].get("optimizer_format", "fully_reshardable")  # what checkpoints before it held
    now = _layout(cfg, dist.get_world_size())
    same_layout = {k: v for k, v in meta["layout"].items() if k != "optimizer_format"} == {
        k: v for k, v in now.items() if k != "optimizer_format"
    }
    request = training_state(actor, {}, is_loading=True, with_rng=same_layout, optimizer_format=saved_format)
    state = _load(request, ckpt_dir)
    for i, chunk in enumerate(actor.chunks):
        _load_model(unwrap(chunk), state[f"model{i}"], ckpt_dir)
    if actor.optimizer is not None:
        with torch.no_grad():  # dp_reshardable copies into fp32 main params that are views of trained parameters
            actor.optimizer.load_state_dict(state["optimizer"])
        _unshare_steps(actor.optimizer)
    if same_layout:
        set_rng_state(state["rng_state"])
    elif dist.get_rank() == 0:
        print(
            f"mgrpo: resume: the layout changed ({_layout_text(meta['layout'])} -> "
            f"{_layout_text(_layout(cfg, dist.get_world_size()))}); dist_checkpointing reshards the model and "
            f"optimizer state; per-rank RNG states restart from the seed",
            file=sys.stderr,
            flush=True,
        )
    if dist.get_rank() == 0:
        print(f"mgrpo: resume: training state loaded in {time.time() - started:.2f} s", file=sys.stderr, flush=True)
    return state["common"]


def _per_rank(value: float) -> list:
    """`value` of every rank, in rank order (a float each, over the CPU group)."""
    from mgrpo.parallel.device import cpu_group

    mine = torch.tensor([float(value)], dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=cpu_group())
    return [round(float(t), 1) for t in out]


def _layout_text(lay: dict) -> str:
    dp = lay["world_size"] // (lay["tp"] * lay["pp"] * lay["cp"])
    return f"TP{lay['tp']} PP{lay['pp']} VPP{lay['vpp'] or 1} CP{lay['cp']} EP{lay['ep']} DP{dp}" + (
        " (distributed optimizer)" if lay.get("distributed_optimizer") else ""
    )


def _load(request: dict, ckpt_dir: str) -> dict:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(request, os.path.join(ckpt_dir, "dist"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointFolderError(
            f"{ckpt_dir}/dist: cannot load ({type(exc).__name__}: {first}); "
            f"a checkpoint file is truncated, damaged or missing"
        ) from None


def _load_model(model, state: dict, ckpt_dir: str) -> None:
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointFolderError(f"{ckpt_dir}: tensors missing from the checkpoint: {missing[:5]}")


def load_checkpoint(model_chunks, ckpt_dir: str) -> dict:
    """Model weights only (the converter), saved at any layout, into these chunks; returns the metadata."""
    meta = read_meta(ckpt_dir)
    state = _load(model_state(model_chunks), ckpt_dir)
    for i, chunk in enumerate(model_chunks):
        _load_model(unwrap(chunk), state[f"model{i}"], ckpt_dir)
    return meta


def pause_point(point: str, step: int) -> None:
    """Test hook (MGRPO_TEST_PAUSE=point:step): rank 0 writes MGRPO_TEST_PAUSE_MARKER and waits to be killed;
    with MGRPO_TEST_MARK=point:step it writes the marker and goes on (a test then signals the run mid-phase);
    MGRPO_TEST_STOP=point:step:rank stops that rank there with SIGSTOP (a hung rank; torchrun's first attempt)."""
    if os.environ.get("MGRPO_TEST_MARK") == f"{point}:{step}" and dist.get_rank() == 0:
        with open(os.environ["MGRPO_TEST_PAUSE_MARKER"], "w") as f:
            f.write(f"{point}:{step}\n")
    stop = os.environ.get("MGRPO_TEST_STOP", "")  # point:step:rank, first attempt only: that rank stops (SIGSTOP)
    if stop == f"{point}:{step}:{dist.get_rank()}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGSTOP)
    if os.environ.get("MGRPO_TEST_PAUSE") == f"{point}:{step}" and dist.get_rank() == 0:
        with open(os.environ["MGRPO_TEST_PAUSE_MARKER"], "w") as f:
            f.write(f"{point}:{step}\n")
        while True:
            time.sleep(1)
