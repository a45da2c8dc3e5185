"""Every study by name (`study=<name>`), and which one a config asks for.

A study is a module of this package holding a `STUDY = Study(...)` record (study.py), its options
dataclass beside it, and a configs/study/<name>.yaml: found by its module alone. A study from outside the
package (a plugin, a test) enters with register(). The short forms `scores=<kind>`, `circuit=<method>`,
`ablate=circuits`, `model=pathnet` and `task=markov` name a study too, each declared by its study's record
(`short_form`, `implied_by`) and handed to the door by forms(); a config whose study disagrees with them is
refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from ..config import Config, option
from ..discovery import declared
from ..errors import UsageError
from .study import Study

DEFAULT = "sweep"
COMMANDS = ("run", "train", "sae")  # `headlab train` and `headlab sae` run the study of their name
REGISTERED: dict[str, Study] = {}  # studies from outside the package, by register()


@cache
def builtin() -> tuple[Study, ...]:
    """The studies of this package's modules, by name; imported on first use."""
    return tuple(sorted(declared(__package__, "STUDY"), key=lambda s: s.name))


def studies() -> dict[str, Study]:
    return {**{s.name: s for s in builtin()}, **REGISTERED}


def options() -> list[tuple[str, str, Any]]:
    """Each study's options with its name filled in (several studies share the plain StudyOptions)."""
    return [("study", name, study.schema(name=name)) for name, study in studies().items()]


def register(study: Study) -> Study:
    """Add a study defined outside headlab (its YAML goes into configs/study/, or HEADLAB_CONFIG_DIR's)."""
    if study.name in {s.name for s in builtin()}:
        raise UsageError(f"study {study.name} is built in; choose another name")
    REGISTERED[study.name] = study
    return study


def get(name: str) -> Study:
    found = studies()
    if name not in found:
        raise UsageError(f"unknown study '{name}'; choose from: {', '.join(sorted(found))}")
    return found[name]


def named_study(overrides: Sequence[str]) -> str | None:
    """The study an override list names outright (`study=NAME`), the last one winning as in Hydra."""
    named = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("study=")]
    return named[-1] if named else None


def forms() -> tuple[dict[str, str], dict[str, str]]:
    """For the door: ({key: the study option `<key>=<value>` sets} for each study with a short form (its
    name is the key), {`group=value` as typed: the study} for each option only one study runs)."""
    found = studies().values()
    short = {s.name: s.short_form for s in found if s.short_form}
    return short, {f"{group}={value}": s.name for s in found for group, value, _ in s.implied_by}


def implied(cfg: Config) -> list[tuple[str, str]]:
    """(the option as a user types it, the study it belongs to) for each option of the config that only
    one study runs (its record's implied_by, whose short forms add `study=<name>` before composing)."""
    return [
        (f"{group}={value}", s.name)
        for s in studies().values()
        for group, value, field in s.implied_by
        if option(getattr(getattr(cfg, group), field)) == value
    ]


def resolve(cfg: Config, named: str | None = None) -> Study:
    """The study of a `headlab run` config: the one its `study` options are (`named`, where the caller
    names one, must be it); refused where an option of the config belongs to another study."""
    name = cfg.study.name if named is None else named
    for form, wanted in implied(cfg):
        if wanted != name:
            raise UsageError(f"study={name} cannot run with {form}, which belongs to study={wanted}: choose one")
    study = get(name)
    study.options(cfg)  # the options composed are this study's
    return study


def study_for(command: str, cfg: Config, named: str | None = None) -> Study:
    """The study that `headlab <command>` runs for this config (cfg.study.name is set to it)."""
    if command == "run":
        return resolve(cfg, named)
    if command not in COMMANDS:
        raise UsageError(f"unknown command '{command}'; choose from: {', '.join(COMMANDS)}")
    study = get(command)
    cfg.study.name = study.name
    return study
