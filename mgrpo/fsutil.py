"""Folder replacement that a kill at any instant cannot turn into 'nothing there'; reading JSON-lines files; whether
a process still runs (from /proc)."""

from __future__ import annotations

import ctypes
import os
import shutil

_RENAME_EXCHANGE = 2  # linux/fs.h


class JsonlLineError(ValueError):
    """Line `line` (1-based) of a JSON-lines file is not JSON; callers name the file and the fix."""

    def __init__(self, line: int, reason: str):
        super().__init__(f"line {line} is not JSON ({reason})")
        self.line, self.reason = line, reason


def read_jsonl(path: str) -> list:
    """Every non-blank line of `path` as JSON; raises JsonlLineError at the first line that is not."""
    import json

    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise JsonlLineError(i + 1, str(exc)) from None
    return rows


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the OS or filesystem can't."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def replace_dir(new: str, final: str, exchange: bool = True) -> None:
    """Move the finished folder `new` to `final`, replacing what was there, then delete the old one.

    Where the OS can, the two folders are swapped in one atomic step, so `final` always holds a complete folder.
    Elsewhere the old folder is renamed aside, the new one renamed in, and only then is the old one deleted:
    between the two renames the complete old folder sits at `final + '.old-<pid>'`. Deleting first, as before,
    left nothing at all if killed in between.
    """
    if os.path.isdir(final) and not os.path.islink(final) and exchange and _exchange(new, final):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old folder
        return
    aside = None
    if os.path.lexists(final):
        aside = f"{final}.old-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(new, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie (killed, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
