"""The studies behind `headlab run`, `headlab train` and `headlab sae`, and which one a config asks for.

Every study is a module with NAME and `run(ctx: RunContext) -> pandas.DataFrame` (the tidy table; what
it adds to meta.json goes into ctx.meta). `headlab run` studies also have `serves(cfg) -> bool`: the
first in RUN_STUDIES that serves a config runs it, the plain sweep last as the fallback.
"""

from __future__ import annotations

from types import ModuleType

from ..config import Config
from ..errors import UsageError

COMMANDS = ("run", "train", "sae")


def run_studies() -> list[ModuleType]:
    from . import circuits, composition, edges, pathnet, retrieval, sinks, sweep

    return [pathnet, edges, circuits, sinks, composition, retrieval, sweep]


def study_for(command: str, cfg: Config) -> ModuleType:
    """The study module that `headlab <command>` runs for this config."""
    if command == "train":
        from . import train

        return train
    if command == "sae":
        from . import sae

        return sae
    if command != "run":
        raise UsageError(f"unknown command '{command}'; choose from: {', '.join(COMMANDS)}")
    return next(study for study in run_studies() if study.serves(cfg))
