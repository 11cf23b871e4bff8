"""`--help` for the trainer, generated from the config dataclasses: every field with its type, default and the
one-line comment beside it in `mgrpo/config.py` (so the help cannot drift from the code)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

USAGE = """usage: mgrpo-train [--config FILE.yaml] [--SECTION.FIELD VALUE ...] [--tp N --pp N --cp N --vpp N --ep N --sp]
                   [--resume [CHECKPOINT]] [--external-plugins FILE.py]
                   [--print-plan [--world-size N] [--plan-attention flash|local] [--plan-gpu h100|h200]]
       (torchrun ... launch/train_grpo.py takes the same flags)

Flags override the YAML; dotted keys reach every field below (--rollout.n 8, --algorithm.loss_type dapo); values
are YAML (--reward.funcs "[accuracy, format]", --logging.wandb "{project: x, mode: offline}"). Every problem is
reported, one line each, before any process group starts (exit 2). Ctrl-C stops cleanly (exit 130).
Words in a flag may be joined by - or _ (--rollout.max-tokens = --rollout.max_tokens), as in mgrpo-convert and
mgrpo-serve.
Short flags: --tp/--pp/--cp/--vpp/--ep/--sp = parallel.tp/pp/cp/vpp/ep/sp.
"""
_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^#]*?(?:#\s*(.*))?$")


def _comments(cls) -> dict:
    """{field: its comment}: the comment on the field's line, else the comment lines just above it."""
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = _FIELD.match(line)
        if m and not stripped.startswith(('"""', "def ", "@")):
            out[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return out


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return "|".join(_type_name(a) for a in args) + ("|null" if type(None) in typing.get_args(tp) else "")
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "{...}" if dataclasses.is_dataclass(value) else str(value)
    return "required"


def _section(cls, prefix: str, lines: list) -> None:
    hints, notes = typing.get_type_hints(cls), _comments(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        if sub is not None:
            _section(sub, f"{prefix}{f.name}.", lines)
            continue
        head = f"  --{prefix}{f.name} {_type_name(hints[f.name])} (default {_default(f)})"
        lines.append(head + (f"\n      {notes[f.name]}" if notes.get(f.name) else ""))


def config_help() -> str:
    from mgrpo.config import Config

    lines = [USAGE]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{f.name}:")
            _section(tp, f"{f.name}.", lines)
        else:
            lines.append(f"  --{f.name.replace('_', '-')} {_type_name(tp)} (default {_default(f)})")
    return "\n".join(lines)
