"""The Study record: what a study is, in one place, so that the registry, the runner, the API and the CLI
ask it instead of guessing from the config or the table."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import Config, config_hash, to_plain
from ..errors import UsageError
from .context import RunContext

# every study's table depends on these, whatever else it reads
ALWAYS_READ = ("study", "name", "seed", "device")


@dataclass(frozen=True)
class Study:
    name: str  # `study=<name>`, configs/study/<name>.yaml
    description: str  # one line, for `headlab list study`
    run: Callable[[RunContext], pd.DataFrame]  # the tidy table; what it adds to meta.json goes into ctx.meta
    summary: Callable[[pd.DataFrame, int], None]  # prints the table for eyes (rich), at most that many rows
    # the top-level config keys the study reads: its run's hash covers these (and ALWAYS_READ), so a
    # change elsewhere does not redo it
    reads: tuple[str, ...]
    # the config sections that hold its options: the Python API looks a bare keyword up there first
    sections: tuple[str, ...] = ()
    figures: str | None = None  # the figure set drawn after every run (figures/registry.py)
    # the dataclass typing `study.options`, for a study whose options have no section of their own
    schema: type | None = None

    def hash(self, cfg: Config) -> str:
        plain = to_plain(cfg)
        plain["study"] = {**plain["study"], "name": self.name}  # whether or not cfg was resolved yet
        return config_hash(plain, (*ALWAYS_READ, *self.reads))

    def options(self, cfg: Config) -> Any:
        """`study.options` typed by the schema (None without one); an unknown key or a wrong type is refused."""
        if self.schema is None:
            if cfg.study.options:
                raise UsageError(f"study={self.name} takes no study.options (given: {', '.join(cfg.study.options)})")
            return None
        try:
            merged = OmegaConf.merge(OmegaConf.structured(self.schema), dict(cfg.study.options))
            return OmegaConf.to_object(merged)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "options"
            raise UsageError(f"study={self.name}: study.options.{key}: {str(e).splitlines()[0]}") from None

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.schema)) if self.schema else ()
