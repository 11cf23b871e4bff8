"""`--external-plugins path/to/plugin.py`: import user files that register rewards, schedulers, environments and
policy losses by name (`register_reward`, `register_scheduler`, `register_env`, `register_policy_loss`).

Only explicit file paths are imported, once each, as modules named `mgrpo_plugin_<stem>`; nothing is searched for
or loaded from the network.
"""

from __future__ import annotations

import importlib.util
import os
import sys


class PluginError(ValueError):
    """A plugin file is missing or raised while importing; the message names it."""


def load_plugins(paths) -> list:
    """Import each file (absolute path, once); returns the module names."""
    names = []
    for path in [paths] if isinstance(paths, str) else list(paths or []):
        full = os.path.abspath(path)
        if not os.path.isfile(full):
            raise PluginError(f"external_plugins: {path!r} not found (relative paths are from {os.getcwd()})")
        if not full.endswith(".py"):
            raise PluginError(f"external_plugins: {path!r} is not a .py file; give the plugin's Python file")
        name = f"mgrpo_plugin_{os.path.splitext(os.path.basename(full))[0]}"
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "")) == full:
            names.append(name)
            continue
        spec = importlib.util.spec_from_file_location(name, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: the reward pool's workers find its functions by module name
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise PluginError(f"external_plugins: {path} raised {type(exc).__name__}: {exc}") from exc
        names.append(name)
    return names
