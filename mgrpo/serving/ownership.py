"""Which trainer may update a rollout server's weights, and which versions it may send (no rollback).

Every PUT and commit names its trainer run (`x-mgrpo-run`: random per fresh run, kept by a resumed run from its
checkpoint) and the process (`x-mgrpo-attempt`: random per start). The first run to send claims the server.

- Another run is refused (409) unless it asks to take over (`x-mgrpo-take-over: 1`, the trainer's
  `rollout.remote.take_over`); a take-over is logged with both run ids.
- Within one process versions strictly increase: an older or equal version is refused (409).
- A new process of the same run is a resume: it claims the server (logged), may start again from its checkpoint's
  version, and the process it replaced is refused from then on (a stale trainer of a requeued job cannot roll the
  weights back).
"""

from __future__ import annotations

RUN_HEADER, ATTEMPT_HEADER, TAKE_OVER_HEADER = "x-mgrpo-run", "x-mgrpo-attempt", "x-mgrpo-take-over"
MAX_ID_CHARS = 64


class Ownership:
    def __init__(self, log=print):
        self.run = self.attempt = None  # the owning trainer run and process
        self.retired: set = set()  # earlier processes of the owning run: refused
        self.floor = None  # the last version the owning process committed
        self.log = log

    def refusal(self, run: str, attempt: str, version: int | None, take_over: bool = False) -> str | None:
        """Why this sender may not stage or commit `version` (None: it may; it owns the server from now on).
        `version` None: a request that sends no weights (opening collective groups)."""
        for name, value in (("run", run), ("attempt", attempt)):
            if not value or len(value) > MAX_ID_CHARS or not value.isascii() or not value.isprintable():
                return f"send x-mgrpo-{name} (at most {MAX_ID_CHARS} printable ASCII characters) with every update"
        if self.run is not None and run != self.run:
            if not take_over:
                return (
                    f"this server takes weights from trainer run {self.run} (version {self.floor}); run {run} is "
                    f"another trainer: stop that one, or set rollout.remote.take_over: true to take the server "
                    f"over"
                )
            self.log(f"trainer run {run} takes the server over from run {self.run} (its last version {self.floor})")
            self.run, self.attempt, self.retired, self.floor = run, attempt, set(), None
            return None
        if self.run is None:
            self.log(f"trainer run {run} (process {attempt}) owns this server's weights from now on")
            self.run, self.attempt = run, attempt
            return None
        if attempt in self.retired:
            return (
                f"process {attempt} of trainer run {run} was replaced by a resumed process ({self.attempt}); "
                f"it may not send weights any more"
            )
        if attempt != self.attempt:
            self.log(
                f"trainer run {run} resumed: process {attempt} replaces {self.attempt} (which had sent version "
                f"{self.floor}); versions may start again from the checkpoint's"
            )
            self.retired.add(self.attempt)
            self.attempt, self.floor = attempt, None
            return None
        if version is not None and self.floor is not None and version <= self.floor:
            return (
                f"version {version} is not newer than version {self.floor}, which trainer run {run} already "
                f"committed here; versions of a run strictly increase"
            )
        return None

    def committed(self, version: int) -> None:
        self.floor = version

    def state(self) -> dict:
        return {"run": self.run, "attempt": self.attempt, "last_committed": self.floor}
