"""Every task by name (`task=<name>`): each module of this package that declares its Task subclass as `TASK`
is a built-in task, found by its module alone (discovery.declared); a task from outside the package (a plugin, a test)
enters with register(). A task's options are its class's `options` dataclass, which the door hands to
Hydra as `task/base_<name>`, so adding a task is writing its module and its configs/task/<name>.yaml."""

from __future__ import annotations

from functools import cache
from typing import Any

from ..discovery import declared
from ..errors import UsageError
from .base import Task

REGISTERED: dict[str, type[Task]] = {}  # tasks from outside the package, by register()


@cache
def builtin() -> dict[str, type[Task]]:
    """The tasks defined in this package's modules, imported on first use."""
    return {task.name: task for task in declared(__package__, "TASK")}


def registry() -> dict[str, type[Task]]:
    """Task name -> its class, which takes the task's options (its `options` dataclass)."""
    return {**builtin(), **REGISTERED}


def register(task: type[Task]) -> type[Task]:
    """Add a task defined outside headlab (its YAML in a config dir: configs/task/, or HEADLAB_CONFIG_DIR's);
    usable as a class decorator."""
    if task.name in builtin():
        raise UsageError(f"task {task.name} is built in; choose another name")
    REGISTERED[task.name] = task
    return task


def options() -> list[tuple[str, str, type]]:
    """Each task's options, for the door (config.ROOMS)."""
    return [("task", name, task.options) for name, task in registry().items()]


def task_names() -> list[str]:
    return sorted(registry())


def build_task(cfg: Any) -> Task:
    """The task a config names (cfg.name), built from that config."""
    known = registry()
    if cfg.name not in known:
        raise UsageError(f"unknown task '{cfg.name}'; choose from: {', '.join(sorted(known))}")
    task: Any = known[cfg.name]  # each task's constructor takes its own options
    return task(cfg)
