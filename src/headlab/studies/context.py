"""What a study runs in: the typed config, where its results go, and the model, task and prompts it
uses, each built on first use (or handed in by the Python API)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import Config, option
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData, build_task

log = logging.getLogger("headlab")
EVAL_SEED_OFFSET = 20_000  # sweep prompts are drawn apart from training batches and training evals


@dataclass
class RunContext:
    cfg: Config
    run_dir: Path | None = None  # None: nothing is written (the Python API's sweep)
    show_progress: bool = False
    task: Task | None = None
    model: HookedModel | None = None
    timings: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # what a study adds to meta.json
    options: Any = None  # the study's own options (study.options), typed by its Study's schema
    _data: TaskData | None = None

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start

    def note(self, text: str) -> None:
        """Something the user should know about this run: logged now, kept in meta.json's notes."""
        log.warning("note: %s", text)
        self.meta.setdefault("notes", []).append(text)

    def get_task(self) -> Task:
        if self.task is None:
            self.task = build_task(self.cfg.task)
        return self.task

    def get_model(self, runs_task: bool = True) -> HookedModel:
        """The model, refused in one line (before it is trained, where it would be) if the task cannot
        run on it; a study that runs no prompts (runs_task=False) takes a pretrained model as it is, and
        the task only says what a model trained here is trained on."""
        task = self.get_task()
        if self.model is None:
            from ..train.obtain import is_trained_here, obtain_model

            wanted = self.cfg.model
            if is_trained_here(self.cfg):
                task.refuse_model(wanted.name, option(wanted.kind) == "hf", task.vocab_size)
            with self.timed("load_model"):
                self.model = obtain_model(self.cfg, task, self.show_progress)
        if self.model.weights is not None:
            self.meta["weights"] = self.model.weights
        if runs_task:
            task.refuse_model(self.model.name, self.model.tokenizer is not None, self.model.vocab_size)
        return self.model

    def get_data(self) -> TaskData:
        """The evaluation prompts (task.n_prompts, drawn from seed + EVAL_SEED_OFFSET) where the model,
        placed on cfg.device, reads its inputs."""
        if self._data is None:
            model, task = self.get_model(), self.get_task()
            with self.timed("build_task"):
                data = task.build(self.cfg.task.n_prompts, seed=self.cfg.seed + EVAL_SEED_OFFSET, model=model)
                model.place(self.cfg.device)
                self._data = data.to(str(model.input_device))
        return self._data


def apply_threads(cfg: Config) -> None:
    """torch's thread count: cfg.threads, else what the launcher allots a job that shares the machine."""
    from ..sweeps import job_threads

    threads = cfg.threads if cfg.threads and cfg.threads > 0 else job_threads()
    if threads:
        torch.set_num_threads(threads)
