"""The Study record: what a study is, in one place, so that the registry, the runner, the API and the CLI
ask it instead of guessing from the config or the table."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..config import Config, cache_key, to_plain
from ..errors import UsageError
from .context import RunContext

# every study's table depends on these besides its own options, whatever else it reads
ALWAYS_READ = ("model", "task", "name", "seed", "device")


@dataclass
class StudyOptions:
    """The options every study has (`study.name`); a study's own options subclass it, in its module."""

    name: str = "sweep"


@dataclass(frozen=True)
class Study:
    name: str  # `study=<name>`, configs/study/<name>.yaml
    description: str  # one line, for `headlab list study`
    run: Callable[[RunContext], pd.DataFrame]  # the tidy table; what it adds to meta.json goes into ctx.meta
    summary: Callable[[pd.DataFrame, int], None]  # prints the table for eyes (rich), at most that many rows
    # the other config groups the study reads (ablate, patch, train, sae): its run's key covers these, its
    # own options and ALWAYS_READ, so a change elsewhere does not redo it
    reads: tuple[str, ...] = ()
    # the config sections besides `study` that hold its options: the Python API looks a bare keyword up
    # in `study`, then there
    sections: tuple[str, ...] = ()
    figures: str | None = None  # the figure set drawn after every run (figures/registry.py)
    # its options (`study.<option>`), a StudyOptions subclass in its module; the registry hands it to Hydra
    # as study/base_<name>
    schema: type = StudyOptions
    # the option that `<name>=<value>` sets: `circuit=eap_ig` is `study=circuit study.method=eap_ig`, and
    # `circuit.<option>` is `study.<option>`
    short_form: str | None = None
    # options of other groups that only this study runs, (group, its value as typed, the composed section's
    # field that holds it): `ablate=circuits` brings study=recall_reasoning where the user names no study
    implied_by: tuple[tuple[str, str, str], ...] = ()

    def hash(self, cfg: Config) -> str:
        """The run's cache key: this study's name and options, what else it reads, and CACHE_VERSION."""
        plain = to_plain(cfg)
        plain.get("engine", {}).pop("max_memory", None)  # a budget changes where the run computes, not what
        plain.get("model", {}).pop("layers_on_disk", None)  # so does where the weights wait
        parts = {key: plain.get(key) for key in (*ALWAYS_READ, *self.reads)}
        return cache_key({**parts, "study": {**plain["study"], "name": self.name}})

    def options(self, cfg: Config) -> Any:
        """cfg.study, which is this study's options once composed with `study=<name>`."""
        if not isinstance(cfg.study, self.schema):
            given = type(cfg.study).__name__
            raise UsageError(f"study={self.name} needs its own options ({self.schema.__name__}), not {given}")
        return cfg.study

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.schema) if f.name != "name")
