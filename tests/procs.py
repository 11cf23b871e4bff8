"""Process checks for tests that start engine processes."""

import os

import psutil


def group_alive(pgid: int) -> list:
    """Live (non-zombie) processes of a process group: an engine process and everything it started."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out
