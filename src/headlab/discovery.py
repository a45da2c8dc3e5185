"""How headlab finds its parts, one way for every kind: a module of the kind's package declares its part in a
module-level name (a task module its `TASK`, a study module its `STUDY`, an SAE architecture's module its
`SAE`, a figure set's module its `FIGURE_SET`), found by importing the package's modules (declared) or, where
importing them is slow, by reading them (declaring: a figure set imports matplotlib, so it is imported when
it draws); a part from outside headlab enters through its kind's register(), from a module HEADLAB_PLUGINS
names (load_plugins)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from pathlib import Path
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


def declaring(package: str, attribute: str) -> list[str]:
    """The modules of `package` (in name order) that assign `attribute` at their top level, read, not imported."""
    found = []
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        path = Path(module.module_finder.path) / f"{module.name}.py"  # type: ignore[union-attr]
        body = ast.parse(path.read_text()).body if path.is_file() else []
        targets = [t for node in body if isinstance(node, ast.Assign) for t in node.targets]
        if any(isinstance(t, ast.Name) and t.id == attribute for t in targets):
            found.append(module.name)
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
