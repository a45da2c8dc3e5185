"""The built-in tasks by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import TaskConfig
from ..errors import UsageError
from .base import Task


def registry() -> dict[str, Callable[[Any], Task]]:
    """Task name -> its class, which takes the task's config (config.py: TaskConfig and subclasses)."""
    from .counting import CountingTask
    from .ioi import IOITask
    from .markov import MarkovTask
    from .needle import NeedleTask
    from .prompts import PromptsTask
    from .recall_reasoning import RecallReasoningTask
    from .text import TextTask

    return {
        "counting": CountingTask,
        "ioi": IOITask,
        "markov": MarkovTask,
        "needle": NeedleTask,
        "prompts": PromptsTask,
        "recall_reasoning": RecallReasoningTask,
        "text": TextTask,
    }


def task_names() -> list[str]:
    return sorted(registry())


def build_task(cfg: TaskConfig) -> Task:
    """The task a config names (cfg.name), built from that config."""
    known = registry()
    if cfg.name not in known:
        raise UsageError(f"unknown task '{cfg.name}'; choose from: {', '.join(sorted(known))}")
    return known[cfg.name](cfg)
