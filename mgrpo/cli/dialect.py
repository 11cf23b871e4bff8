"""One flag dialect for mgrpo-train, mgrpo-convert and mgrpo-serve.

Every tool takes `--name value`, `--name=value` and a bare `--switch` for a boolean; a flag's words may be joined
by `-` or `_` (`--max-shard-size` = `--max_shard_size`, `--rollout.max-new-tokens` = `--rollout.max_new_tokens`),
as in vLLM's and SGLang's own CLIs; a wrong flag is one line naming it and `--help`, exit 2. The trainer's dotted
`--section.field` keys reach every config field (mgrpo/config.py); the converter and the server are argparse with
their defaults shown in `--help`.
"""

from __future__ import annotations

import argparse
import sys


def trainer_flags(argv: list) -> list:
    """The trainer's flags in the config's spelling: dotted keys with `_` (the dataclass fields), plain flags
    with `-` (--print-plan, --world-size, --external-plugins)."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            key = "--" + (key[2:].replace("-", "_") if "." in key else key[2:].replace("_", "-"))
            arg = key + eq + value
        out.append(arg)
    return out


def _dashed(arg: str) -> str:
    key, eq, value = arg.partition("=")
    return "--" + key[2:].replace("_", "-") + eq + value


class FlagParser(argparse.ArgumentParser):
    """argparse in the dialect above: `_` or `-` inside flag names, defaults in `--help`, the module docstring
    (its usage examples) as the description, and a one-line error. Arguments after `--` are passed through
    untouched (the server hands them to vLLM)."""

    def __init__(self, prog: str, doc: str | None):
        super().__init__(prog=prog, description=doc, formatter_class=_Formatter)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        cut = args.index("--") if "--" in args else len(args)
        head = [_dashed(a) if a.startswith("--") else a for a in args[:cut]]
        namespace, unknown = super().parse_known_args(head, namespace)
        return namespace, unknown + args[cut + 1 :]

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written (its examples keep their lines), and every flag's default."""
