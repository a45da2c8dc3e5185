"""Composing a run's config: Hydra's composition of configs/ plus overrides, validation at the door
(one line for an unknown option, key, type or value out of range), the typed result, the short forms that
name a study (each declared by its study's record), and Python keyword options as overrides. Each group's
options live beside the code that reads them (config.ROOMS lists the rooms), each rule with its field
(config_rules.setting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from .config import GROUPS, ROOMS, Config, EngineConfig, OutputConfig, config_dir
from .config_rules import check_device, clipped, validate
from .errors import UsageError
from .models.loading import model_name


def is_schema_option(name: str) -> bool:
    return name.startswith("base_")


STORED: dict[tuple[str, str], Any] = {}  # what schemas() has handed to Hydra's ConfigStore


def schemas() -> dict[str, dict[str, Any]]:
    """Every group's options dataclasses by name, from each room's source, each stored in Hydra's
    ConfigStore as `<group>/base_<name>` (a task or study registered since is stored on the next call)."""
    found: dict[str, dict[str, Any]] = {}
    for room in ROOMS:
        for group, name, schema in importlib.import_module(room).options():
            found.setdefault(group, {})[name] = schema
            if STORED.get((group, name)) != schema:  # an instance (a study's named options) compares by value
                ConfigStore.instance().store(group=group, name=f"base_{name}", node=schema)
                STORED[(group, name)] = schema
    return found


# `scores=<study>` is `study=<study>` and `scores.<option>` is `study.<option>`; the short forms that
# name one study come from the rooms that hold studies (a room's forms(): studies.registry's, from each
# study's record).
ANY_STUDY = "scores"


def _study_forms() -> tuple[dict[str, str], dict[str, str]]:
    """({key: the study option `<key>=<value>` sets}, {`group=value` as typed: the study it brings})."""
    short: dict[str, str] = {}
    implied: dict[str, str] = {}
    for room in ROOMS:
        module = importlib.import_module(room)
        if hasattr(module, "forms"):
            more_short, more_implied = module.forms()
            short |= more_short
            implied |= more_implied
    return short, implied


def expand_short_forms(overrides: Sequence[str]) -> list[str]:
    """The overrides with each short form spelled as its study (`<study>=<value>` where the study's
    record has a short_form, `scores=<study>`, an option only one study runs); two that name different
    studies are refused in one line."""
    short, implied = _study_forms()
    prefixes = tuple(f"{name}." for name in (ANY_STUDY, *short))
    out: list[str] = []
    named: list[tuple[str, str]] = []  # (as the user typed it, the study it names)
    for override in overrides:
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")
        if sep and (bare in short or bare == ANY_STUDY):
            named.append((override, bare if bare in short else value))
            out += [f"study={bare}", f"study.{short[bare]}={value}"] if bare in short else [f"study={value}"]
            continue
        old = next((p for p in prefixes if bare.startswith(p)), None)
        if old is not None:
            out.append(f"{key[: len(key) - len(bare)]}study.{bare[len(old) :]}{sep}{value}")
            continue
        if bare == "study" and sep:
            named.append((override, value))
        elif override in implied:
            named.append((override, implied[override]))
        out.append(override)
    explicit = [study for typed, study in named if typed.lstrip("+").startswith("study=")]
    for typed, study in named:
        if explicit and study != explicit[-1]:
            raise UsageError(
                f"study={explicit[-1]} cannot run with {typed}, which belongs to study={study}: choose one"
            )
    if len({study for _, study in named}) > 1:
        (a, first), (b, second) = named[0], next(n for n in named if n[1] != named[0][1])
        raise UsageError(f"{a} runs study={first} but {b} runs study={second}: choose one study")
    if named and not any(o.lstrip("+").startswith("study=") for o in out):
        out.append(f"study={named[0][1]}")
    return out


@contextlib.contextmanager
def _configs() -> Iterator[None]:
    """Hydra's compose API on configs/, also inside a job that Hydra's own main runs (a multirun's job whose
    study composes further configs, as the atlas's probes do): that job's Hydra is set aside and put back."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    schemas()
    outer = get_gh_backup() if GlobalHydra.instance().is_initialized() else None
    if outer is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            yield
    finally:
        if outer is not None:
            restore_gh_from_backup(outer)


@cache
def group_options(group: str) -> tuple[str, ...]:
    """The options of a config group (the YAML files of configs/<group>/), schemas left out."""
    from hydra.core.global_hydra import GlobalHydra

    with _configs():
        names = GlobalHydra.instance().config_loader().get_group_options(group)
    return tuple(sorted(n for n in names if not is_schema_option(n)))


def compose_raw(overrides: Sequence[str] = (), hydra_config: bool = False) -> DictConfig:
    """The config Hydra composes from configs/ and the overrides (untyped, as a Hydra job sees it)."""
    from hydra import compose as hydra_compose

    with _configs():
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def typed(cfg: DictConfig, device: bool = True) -> Config:
    """The composed config as the dataclasses above, every value checked against config_rules (and, with
    `device`, cfg.device against this machine): the core never sees an untyped or unchecked config."""
    if "hydra" in cfg:
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    try:
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except Exception as e:  # a value no override gave (MISSING) or that cannot take its type
        raise UsageError(f"invalid configuration: {_one_line(e)}") from None
    config.model.name = model_name(config.model)
    validate(config, device)
    return config


def compose(overrides: Sequence[str] = ()) -> Config:
    """The typed, validated config of `headlab run <overrides>`; bad input raises UsageError."""
    return compose_checked(overrides)[1]


def compose_checked(
    overrides: Sequence[str] = (), hydra_config: bool = False, device: bool = True
) -> tuple[DictConfig, Config]:
    """(the composed config as Hydra gives it, the typed and validated one): one composition, every
    check of the door, the group options named before anything is composed."""
    overrides = expand_short_forms(overrides)
    check_overrides(overrides)
    try:
        raw = compose_raw(overrides, hydra_config)
    except Exception as e:
        raise UsageError(f"invalid configuration: {_one_line(e)}") from None
    return raw, typed(raw, device)


def _one_line(e: BaseException) -> str:
    """OmegaConf's and Hydra's multi-line errors as one line that names the option (its full key)."""
    chain: list[BaseException] = []
    link: BaseException | None = e
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    for err in chain:
        key = getattr(err, "full_key", None)
        msg = getattr(err, "msg", None)
        if key and msg:
            first = str(msg).strip().splitlines()[0]
            # an enum's members as a plain list: the line is printed as rich markup, where [..] is a tag
            member = re.fullmatch(r"Invalid value '(.*)', expected one of \[(.*)\]", first)
            return clipped(f"{key}={member[1]}: expected one of {member[2]}" if member else f"{key}: {first}")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in lines:
            lines.append(first)
    return clipped("; ".join(lines[:2]) or type(e).__name__)


def check_overrides(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides parsed, each group option one configs/ has, before anything is composed; returns
    each override's values (several for a sweep's comma-separated ones) as `key=value` strings."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise UsageError(f"bad override: {_one_line(e)}") from e
    choices: list[list[str]] = []
    for o in parsed:
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        group = o.key_or_group.lstrip("+~")
        if group in GROUPS and not o.is_delete():
            valid = group_options(group)
            for v in values:
                if v not in valid and not (group == "experiment" and v == "null"):
                    raise UsageError(f"unknown {group} '{v}'; choose from: {', '.join(valid)}")
        choices.append([f"{o.get_key_element()}={v}" for v in values])
    return choices


def validate_overrides(
    overrides: Sequence[str], check_job: Callable[[Config, list[str]], object] | None = None
) -> tuple[DictConfig, Config]:
    """A sweep checked at the door, value by value: the first job's config, then each other value of
    each swept option in it, each composed and validated (and given to check_job with its overrides:
    the caller's own check, e.g. that the job names one study); returns the first job's (raw with
    Hydra's config, typed). Jobs that a cluster runs elsewhere have their device checked there."""
    choices = check_overrides(expand_short_forms(overrides))
    base = [c[0] for c in choices]
    raw, cfg = compose_checked(base, hydra_config=True, device=False)
    here = not runs_elsewhere(raw)
    if here:
        check_device(cfg.device)
    if check_job is not None:
        check_job(typed(raw, device=False), base)
    for i, c in enumerate(choices):
        for v in c[1:]:
            job = base[:i] + [v] + base[i + 1 :]
            job_cfg = compose_checked(job, device=here)[1]
            if check_job is not None:
                check_job(job_cfg, job)
    return raw, cfg


def launcher_of(raw: DictConfig) -> tuple[str, str]:
    """(the sweep's launcher as the user chose it, "slurm" where its jobs go to a SLURM cluster, else "")."""
    target = str(OmegaConf.select(raw, "hydra.launcher._target_", default="") or "")
    name = OmegaConf.select(raw, "hydra.runtime.choices", default={}).get("hydra/launcher") or target or "basic"
    return str(name), "slurm" if "slurm" in target.lower() else ""


def runs_elsewhere(raw: DictConfig) -> bool:
    """A launcher whose jobs run on other machines (SLURM's): their devices are theirs, not this one's."""
    return launcher_of(raw)[1] != ""


# Sections searched for a bare option name (`n_boot` -> output.n_boot), in this order.
SECTIONS = ("", "output", "engine", "study", "ablate", "patch", "task", "model", "train", "sae")


def option_overrides(options: dict[str, Any], prefer: Sequence[str] = ()) -> list[str]:
    """Python keyword options as overrides: `output__n_boot=100` or `n_boot=100` -> "output.n_boot=100".

    A bare name is looked up in the `prefer` sections first, then in every section; a name found in
    more than one section must be spelled with its section."""
    fields_of = {"": {f.name for f in dataclasses.fields(Config)}}
    for section, schema in {"engine": EngineConfig, "output": OutputConfig}.items():
        fields_of[section] = {f.name for f in dataclasses.fields(schema)}
    for group, named in schemas().items():
        fields_of[group] = {f.name for schema in named.values() for f in dataclasses.fields(schema)}
    out = []
    for key, value in options.items():
        path = key.replace("__", ".")
        if "." not in path:
            for sections in ([s for s in prefer], [s for s in SECTIONS if s not in prefer]):
                found = [s for s in sections if path in fields_of.get(s, ())]
                if len(found) > 1 and sections is not prefer:
                    spelled = ", ".join(f"{s}__{path}" for s in found)
                    raise UsageError(f"option '{key}' is ambiguous; write one of: {spelled}")
                if found:
                    path = f"{found[0]}.{path}" if found[0] else path
                    break
        out.append(f"{path}={_override_value(value)}")
    return out


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(getattr(value, "value", value))
