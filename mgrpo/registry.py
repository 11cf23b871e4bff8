"""One registry helper for every name -> object table (rewards, engines, model families, schedulers, environments,
policy losses, advantages, KL estimators).

Rules, the same for all: the built-ins load before any other registration or lookup, so a plugin always meets
them; a name registered twice by two different objects is an error naming both places; a plugin replaces a name
only by saying so (`override=True`); the object registered again (a module imported twice) is no change. Config
validation lists valid names from the same tables. A Registry is also a read/write mapping, so ms-swift's
`multi_turns["name"] = cls` plugins keep working (and meet the same duplicate check).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import MutableMapping
from typing import Any, Callable


class DuplicateNameError(ValueError):
    """A name registered twice without override=True; the message names both places."""


def _short(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path


def where_defined(obj: Any) -> str | None:
    """file:line where a function or class is defined (None for other objects)."""
    try:
        target = inspect.unwrap(obj)
        return f"{_short(inspect.getsourcefile(target))}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return None


def _where(obj: Any, frame_depth: int) -> str:
    """Where `obj` is defined, else the line that registered it."""
    found = where_defined(obj) if callable(obj) else None
    if found is None:
        frame = sys._getframe(frame_depth)
        found = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
    return found


def _module(obj: Any) -> str:
    return getattr(getattr(obj, "fn", obj), "__module__", "") or ""


def _identity(obj: Any) -> str:
    """What makes two registrations the same object: its module and qualified name (a class or function
    imported twice compares equal), else the object itself."""
    fn = getattr(obj, "fn", obj)  # a spec wrapping a function (rewards) is that function
    name = getattr(fn, "__qualname__", None)
    return f"{getattr(fn, '__module__', '?')}.{name}" if name else repr(id(fn))


class Registry(MutableMapping):
    """name -> object for one kind. `builtins`: modules whose import registers the built-in names."""

    def __init__(self, kind: str, builtins: tuple = (), aliases: dict | None = None):
        self.kind, self.builtins, self.aliases = kind, tuple(builtins), dict(aliases or {})
        self._table: dict = {}
        self._where: dict = {}
        self._state = "new"  # new -> loading -> loaded

    def load_builtins(self) -> None:
        if self._state != "new":
            return
        self._state = "loading"
        try:
            for module in self.builtins:
                importlib.import_module(module)
        except BaseException:
            self._state = "new"
            raise
        self._state = "loaded"

    def add(self, name: str, obj: Any, override: bool = False, where: str | None = None) -> Any:
        if _module(obj) not in self.builtins:  # a plugin meets the built-ins now, not when they load later
            self.load_builtins()
        where = where or _where(obj, 3)
        old = self._table.get(name)
        if old is not None and not override and _identity(old) != _identity(obj):
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: at {self._where[name]} and at {where}; register yours "
                f"under another name, or pass override=True to replace the first"
            )
        self._table[name], self._where[name] = obj, where
        return obj

    def register(self, *names: str, override: bool = False) -> Callable:
        """`@REGISTRY.register("name", "alias")` on a function or class."""

        def deco(obj):
            for name in names:
                self.add(name, obj, override, _where(obj, 2))
            return obj

        return deco

    def get(self, name: str, default: Any = None) -> Any:
        self.load_builtins()
        return self._table.get(self.aliases.get(name, name), default)

    def lookup(self, name: str, field: str = "") -> Any:
        """The object under `name` (or an alias); KeyError naming the field and the known names otherwise."""
        self.load_builtins()
        key = self.aliases.get(name, name)
        if key not in self._table:
            raise KeyError(
                f"{field + '=' if field else ''}{name!r}: no {self.kind} of that name is registered; "
                f"known: {', '.join(self.names())}"
            )
        return self._table[key]

    def names(self) -> list:
        self.load_builtins()
        return sorted(set(self._table) | set(self.aliases))

    def where(self, name: str) -> str:
        return self._where[name]

    # the mapping view: ms-swift's dict registries (multi_turns, envs)
    def __getitem__(self, name: str) -> Any:
        self.load_builtins()
        return self._table[self.aliases.get(name, name)]

    def __setitem__(self, name: str, obj: Any) -> None:
        self.add(name, obj, where=_where(obj, 2))

    def __delitem__(self, name: str) -> None:
        del self._table[name], self._where[name]

    def __iter__(self):
        self.load_builtins()
        return iter(dict(self._table))

    def __len__(self) -> int:
        self.load_builtins()
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        self.load_builtins()
        return name in self._table or name in self.aliases

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._table)})"
