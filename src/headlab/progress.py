"""Progress bars for long work (rich), quiet when disabled or when output is not a terminal; each says how
many torch threads the work runs on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class _Bar:
    def __init__(self, progress: Progress | None, task_id: TaskID | None):
        self._progress, self._task = progress, task_id

    def update(self, completed: int, info: str = "") -> None:
        if self._progress is not None:
            assert self._task is not None  # set together with the progress
            kwargs: dict[str, Any] = {"info": info} if info else {}
            self._progress.update(self._task, completed=completed, **kwargs)


@contextmanager
def progress_bar(description: str, total: int, completed: int = 0, enabled: bool = True) -> Iterator[_Bar]:
    if not enabled:
        yield _Bar(None, None)
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        TextColumn(f"[dim]{torch.get_num_threads()} torch threads"),
        transient=False,
    )
    with progress:
        task_id = progress.add_task(description, total=total, completed=completed, info="")
        yield _Bar(progress, task_id)
