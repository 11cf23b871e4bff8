"""`--resume`: which checkpoint, and whether this run may continue it. Checked by the launcher before any process
group starts or any file is written; every refusal is one line that names the field.

May change on resume: the parallel layout (dist_checkpointing reshards; with the distributed optimizer only DP,
unless the checkpoint was saved with checkpoint.reshardable), train.steps, logging, and the rest of the config
(each change is printed). May not: the model's shapes and vocabulary, model.params_dtype, the policy loss
and advantage, rollout.n and train.seed (the continued run would not be the same run), and
train.use_distributed_optimizer (megatron-core 0.16 loads neither optimizer's state into the other).
"""

from __future__ import annotations

import hashlib
import json
import os

import yaml

from mgrpo.checkpoint import CheckpointFolderError, complete_checkpoints, read_meta, resolve

FIXED = (
    "model.params_dtype",
    "algorithm.policy_loss",
    "algorithm.advantage",
    "rollout.n",
    "train.seed",
    "train.use_distributed_optimizer",  # megatron-core 0.16 cannot load one optimizer's state into the other
    "model.lora.rank",
    "model.lora.alpha",
    "model.lora.target_modules",
)  # the adapters' shapes and function
FREE = {"train.steps", "model.path", "external_plugins", "rollout.remote.run_id"}  # not reported
FREE_SECTIONS = ("checkpoint.", "logging.", "parallel.", "model.tiny")
MODEL_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "vocab_size",
    "tie_word_embeddings",
)


class ResumeError(ValueError):
    """Lines, one per refusal, each naming the field or file and the fix."""

    def __init__(self, lines: list):
        super().__init__("\n".join(lines))
        self.lines = lines


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _digest(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def model_differences(ckpt_dir: str, model_dir: str) -> list:
    """Shapes and vocabulary of the checkpoint's model against model.path's."""
    mine, saved = _json(os.path.join(model_dir, "config.json")), _json(os.path.join(ckpt_dir, "hf", "config.json"))
    out = [
        f"{k} is {saved.get(k)} in the checkpoint and {mine.get(k)} in model.path={model_dir}"
        for k in MODEL_KEYS
        if saved.get(k) != mine.get(k)
    ]
    a, b = _digest(os.path.join(ckpt_dir, "hf", "tokenizer.json")), _digest(os.path.join(model_dir, "tokenizer.json"))
    if a and b and a != b:
        out.append(f"tokenizer.json differs from model.path={model_dir}'s (another vocabulary)")
    return out


def _optimizer_layout_problems(path: str, saved: dict, cfg) -> list:
    """A distributed optimizer saved per DP shard (checkpoint.reshardable false: megatron's dp_reshardable) loads
    only at the model-parallel layout it was saved at; DP may change."""
    if not saved.get("distributed_optimizer") or saved.get("optimizer_format", "fully_reshardable") != "dp_reshardable":
        return []
    p = cfg.parallel
    now = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep}
    moved = [f"{k.upper()} {saved.get(k) or 1} -> {v or 1}" for k, v in now.items() if (saved.get(k) or 1) != (v or 1)]
    if not moved:
        return []
    return [
        f"--resume {path}: the distributed optimizer's state was saved per data-parallel shard "
        f"(checkpoint.reshardable false), which loads only at its TP/PP/VPP/CP/EP ({', '.join(moved)}); resume at "
        f"the saved layout (DP may change), and save with --checkpoint.reshardable true to change it later"
    ]


def check_resume(cfg) -> list:
    """Resolve cfg.checkpoint.resume to a complete checkpoint folder (in place) and check that this run may continue
    it. Returns notes (what changed) to print; raises ResumeError (each line names the field) or nothing at all."""
    from mgrpo.config import to_dict

    c = cfg.checkpoint
    if c.resume == "auto":  # verl's resume_mode auto: the newest checkpoint if there is one, else a fresh run
        if not (c.save_dir and complete_checkpoints(c.save_dir)):
            c.resume = ""
            cfg.logging.overwrite = True  # a torchrun restart before the first save replaces its own logs
            return [f"mgrpo: --resume auto: no checkpoint in checkpoint.save_dir={c.save_dir} yet: a fresh run"]
        c.resume = "latest"
    try:
        path = resolve(c.resume, c.save_dir)
        meta = read_meta(path)
    except CheckpointFolderError as exc:
        raise ResumeError([f"--resume: {exc}"]) from None
    differences, errors = model_differences(path, cfg.model.path), []
    if differences:
        errors.append(
            f"--resume {path}: the checkpoint is of another model: {'; '.join(differences)}; resume with "
            f"the model it was trained from (or start a new run)"
        )
    try:
        with open(os.path.join(path, "config.yaml")) as f:
            saved = _flat(yaml.safe_load(f))
    except (OSError, yaml.YAMLError) as exc:
        raise ResumeError(
            [f"--resume: {path}/config.yaml: unreadable ({exc}); resume from another checkpoint"]
        ) from None
    now = _flat(to_dict(cfg))
    for key in FIXED:
        if key in saved and saved[key] != now.get(key):
            errors.append(
                f"--resume {path}: {key}={now.get(key)!r} but the checkpoint was trained with "
                f"{saved[key]!r}; a resumed run keeps {key} (set it back or start a new run)"
            )
    errors += _optimizer_layout_problems(path, meta["layout"], cfg)
    step = meta["step"]
    if not errors and step >= cfg.train.steps:
        errors.append(
            f"--resume {path}: the checkpoint is at step {step} and train.steps={cfg.train.steps}: nothing "
            f"to train; raise train.steps above {step}"
        )
    if errors:
        raise ResumeError(errors)
    c.resume = path  # every rank loads this folder, even if `latest` moves on
    changed = [
        f"{k} {saved[k]!r} -> {now.get(k)!r}"
        for k in sorted(saved)
        if k not in FIXED and k not in FREE and not k.startswith(FREE_SECTIONS) and saved[k] != now.get(k)
    ]
    notes = [f"mgrpo: resuming from {path} (step {step}, weight version {meta['state']['weight_version']})"]
    if saved.get("train.steps") != cfg.train.steps and cfg.train.lr_schedule != "constant":
        notes.append(
            f"mgrpo: resume: train.steps {saved.get('train.steps')} -> {cfg.train.steps}: the "
            f"{cfg.train.lr_schedule} LR schedule now ends at this run's last step"
        )
    if changed:
        notes.append("mgrpo: resume: changed since the checkpoint: " + "; ".join(changed))
    return notes
