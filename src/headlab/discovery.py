"""How headlab finds its parts, one way for every kind: a module of the kind's package declares its part in a
module-level name (a task module its `TASK`, a study module its `STUDY`, an SAE architecture's module its
`SAE`, a figure set's module its `FIGURES` name), found by importing the package's modules; a part from
outside headlab enters through its kind's register(), from a module HEADLAB_PLUGINS names (load_plugins)."""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Any

from .errors import UsageError


def declared(package: str, attribute: str) -> list[Any]:
    """What each module of `package` (imported, in name order) declares under `attribute`, where it does."""
    found = []
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        value = getattr(importlib.import_module(f"{package}.{module.name}"), attribute, None)
        if value is not None:
            found.append(value)
    return found


def load_plugins() -> list[str]:
    """Import the modules named in $HEADLAB_PLUGINS (comma-separated): a user's own tasks, studies, SAE
    architectures, atlas probes and circuit methods, which register themselves as they are imported;
    `headlab` does this as it starts."""
    names = [n.strip() for n in os.environ.get("HEADLAB_PLUGINS", "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"HEADLAB_PLUGINS: cannot import {name} ({e})") from None
    return names
