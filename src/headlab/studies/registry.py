"""Every study by name (`study=<name>`), and which one a config asks for.

A study is a module holding a `STUDY = Study(...)` record (study.py) and a configs/study/<name>.yaml; the
module's name goes into BUILTIN below. A study from outside the package (a plugin, a test) enters with
register(). The short forms `scores=<kind>`, `circuit=<method>`, `ablate=circuits`, `model=pathnet` and
`task=markov` name a study too; a config whose names disagree is refused in one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ..config import Config, option
from ..errors import UsageError
from .study import Study

DEFAULT = "sweep"
COMMANDS = ("run", "train", "sae")  # `headlab train` and `headlab sae` run the study of their name
REGISTERED: dict[str, Study] = {}  # studies from outside the package, by register()


# the built-in studies' modules, in the order `headlab list study` shows them: adding one is adding its name
BUILTIN = (
    "sweep",
    "circuit",
    "recall_reasoning",
    "sinks",
    "composition",
    "retrieval",
    "induction",
    "ioi_classes",
    "atlas",
    "pathnet",
    "train",
    "sae",
)


def builtin() -> tuple[Study, ...]:
    # imported on first use: `headlab list` and config composition need no torch model code
    return tuple(importlib.import_module(f"{__package__}.{name}").STUDY for name in BUILTIN)


def studies() -> dict[str, Study]:
    return {**{s.name: s for s in builtin()}, **REGISTERED}


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


def short_forms(cfg: Config) -> list[tuple[str, str]]:
    """(the option as a user types it, the study it names) for each short form the config sets."""
    found = []
    if option(cfg.scores.kind) != "none":
        found.append((f"scores={option(cfg.scores.kind)}", option(cfg.scores.kind)))
    if option(cfg.circuit.method) != "none":
        found.append((f"circuit={option(cfg.circuit.method)}", "circuit"))
    if option(cfg.ablate.sweep) == "circuits":
        found.append(("ablate=circuits", "recall_reasoning"))
    if option(cfg.model.kind) == "pathnet":
        found.append((f"model={cfg.model.name}", "pathnet"))
    if cfg.task.name == "markov":
        found.append(("task=markov", "pathnet"))
    return found


def resolve(cfg: Config, named: str | None = None) -> Study:
    """The study of a `headlab run` config: the one `study=` names (`named`, or any but the default in the
    config), else the one its short forms name, else the sweep; cfg.study.name is set to it."""
    if named is None and cfg.study.name != DEFAULT:
        named = cfg.study.name
    forms = short_forms(cfg)
    if named is not None:
        for form, wanted in forms:
            if wanted != named:
                raise UsageError(f"study={named} cannot run with {form}, which belongs to study={wanted}: choose one")
    else:
        for form, wanted in forms[1:]:
            if wanted != forms[0][1]:
                raise UsageError(
                    f"{forms[0][0]} runs study={forms[0][1]} but {form} runs study={wanted}: choose one study"
                )
    study = get(named or (forms[0][1] if forms else DEFAULT))
    study.options(cfg)  # bad options are refused before any work
    cfg.study.name = study.name
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


def legacy_hash_holds(command: str, cfg: Config) -> bool:
    """Whether a run dir from before studies had names may hold this run: its whole-config hash (which
    knows no study) meant the same study only where the short forms (or the command) chose it."""
    if cfg.study.options:
        return False
    if command != "run":
        return cfg.study.name == command
    forms = short_forms(cfg)
    return cfg.study.name == (forms[0][1] if forms else DEFAULT)
