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
from ..config_rules import refusal
from ..interventions.plan import Intervention
from ..models.hooked import HookedModel
from ..runtime import IDLE, Threads, choose_threads, tune_allocator
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
    data: TaskData | None = None  # the prompts where the Python API hands them in (headlab.execute)
    # the sweep's interventions where the Python API hands them in (headlab.execute); None: the config's plan
    interventions: list[Intervention] | None = None
    options: Any = None  # the study's own options (study.options), typed by its Study's schema
    threads: Threads | None = None  # how the run chose its torch threads (apply_runtime), where it chose them
    _data: TaskData | None = None
    _prompts: TaskData | None = None  # built, checked, not yet placed on the model's device

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Time a phase of the run; where its threads came from the cores' use (threads unset), choose
        them again for this phase, as other work may have come or gone (meta.json's threads_by_phase)."""
        if self.threads is not None and self.threads.source == IDLE:
            self.threads = choose_threads(self.cfg.threads)
            torch.set_num_threads(self.threads.threads)
            self.meta.setdefault("threads_by_phase", {})[stage] = self.threads.threads
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
                # a toy model's prompts are the task's alone: a bad position is refused before training
                if runs_task and option(wanted.kind) == "toy" and positions_to_check(self.cfg):
                    self.prompts(None)
            with self.timed("load_model"):
                self.model = obtain_model(self.cfg, task, self.show_progress)
        if self.model.weights is not None:
            self.meta["weights"] = self.model.weights
        if runs_task:
            task.refuse_model(self.model.name, self.model.tokenizer is not None, self.model.vocab_size)
        return self.model

    def get_data(self) -> TaskData:
        """The evaluation prompts (those handed in, else task.n_prompts drawn from seed + EVAL_SEED_OFFSET)
        where the model, placed on cfg.device, reads its inputs."""
        if self._data is None:
            model = self.get_model()
            data = self.prompts(model)
            with self.timed("build_task"):
                model.place(self.cfg.device)
                self._data = data.to(str(model.input_device))
        return self._data

    def prompts(self, model: HookedModel | None) -> TaskData:
        """The evaluation prompts, built once (for `model`'s tokenizer; None: a task with its own
        vocabulary) and checked against patch.positions before anything is swept."""
        if self._prompts is None:
            task, data = self.get_task(), self.data
            if data is None:
                with self.timed("build_task"):
                    data = task.build(self.cfg.task.n_prompts, seed=self.cfg.seed + EVAL_SEED_OFFSET, model=model)
            check_positions(positions_to_check(self.cfg), data, task.name)
            if (start := task.prompt_start()) is not None:
                self.meta["prompt_start"] = start
            self._prompts = data
        return self._prompts


def positions_to_check(cfg: Config) -> list[str]:
    """patch.positions other than `all`: indices and roles, which only the prompts can confirm."""
    return [str(p) for p in cfg.patch.positions if str(p) != "all"]


def check_positions(positions: list[str], data: TaskData, task: str) -> None:
    """Each index within the longest prompt, each role one the task names, else one line."""
    width = max(int(t.shape[-1]) for t in data.inputs.values())
    roles = list(data.token_positions or {})
    for p in positions:
        if p.lstrip("-").isdigit() and not -width <= int(p) < width:
            expected = f"an index in [{-width}, {width - 1}] (task {task}'s longest prompt has {width} tokens)"
            raise refusal("patch.positions", p, expected)
        if not p.lstrip("-").isdigit() and p not in roles:
            raise refusal(
                "patch.positions", p, f"all, an index, or a role task {task} names: {', '.join(roles) or 'none'}"
            )


def apply_runtime(cfg: Config) -> Threads:
    """What every run sets in its process, from the shell or from Python: glibc's allocator tuned
    (runtime.tune_allocator) and torch's thread count (runtime.choose_threads: cfg.threads, a launcher's
    allotment, or the idle cores), set and said in one line."""
    tune_allocator()
    choice = choose_threads(cfg.threads)
    torch.set_num_threads(choice.threads)
    log.info(choice.line())
    return choice
