"""Composing a run's config: Hydra's composition of configs/ plus overrides, validation at the door
(one line for an unknown option, key or type), the typed result, and Python keyword options as
overrides. The schemas themselves live in config.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from .config import GROUPS, SCHEMAS, TASK_SCHEMAS, Config, EngineConfig, OutputConfig, TaskConfig, config_dir
from .errors import UsageError


def is_schema_option(name: str) -> bool:
    return name.startswith("base_")


@cache
def group_options(group: str) -> tuple[str, ...]:
    """The options of a config group (the YAML files of configs/<group>/), schemas left out."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        names = GlobalHydra.instance().config_loader().get_group_options(group)
    return tuple(sorted(n for n in names if not is_schema_option(n)))


def compose_raw(overrides: Sequence[str] = (), hydra_config: bool = False) -> DictConfig:
    """The config Hydra composes from configs/ and the overrides (untyped, as a Hydra job sees it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def typed(cfg: DictConfig) -> Config:
    """The composed config as the dataclasses above: the core never sees an untyped config."""
    if "hydra" in cfg:
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def compose(overrides: Sequence[str] = ()) -> Config:
    """The typed, validated config of `headlab run <overrides>`; bad input raises UsageError."""
    validate_overrides(overrides)
    return typed(compose_raw(overrides))


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in lines:
            lines.append(first)
    return "; ".join(lines[:2]) or type(e).__name__


def validate_overrides(overrides: Sequence[str]) -> None:
    """Fail with one line on an unknown group option, key or wrong type, before any work; a sweep
    (comma-separated values) is checked value by value."""
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
    base = [c[0] for c in choices]
    variants = [base] + [base[:i] + [v] + base[i + 1 :] for i, c in enumerate(choices) for v in c[1:]]
    for variant in variants:
        try:
            compose_raw(variant)
        except Exception as e:
            raise UsageError(f"invalid configuration: {_one_line(e)}") from e


# Sections searched for a bare option name (`n_boot` -> output.n_boot), in this order.
SECTIONS = ("", "output", "engine", "ablate", "patch", "circuit", "task", "model", "train", "sae")


def option_overrides(options: dict[str, Any], prefer: Sequence[str] = ()) -> list[str]:
    """Python keyword options as overrides: `output__n_boot=100` or `n_boot=100` -> "output.n_boot=100".

    A bare name is looked up in the `prefer` sections first, then in every section; a name found in
    more than one section must be spelled with its section."""
    fields_of = {"": {f.name for f in dataclasses.fields(Config)}}
    for section, schema in {**SCHEMAS, "task": TaskConfig, "engine": EngineConfig, "output": OutputConfig}.items():
        fields_of[section] = {f.name for f in dataclasses.fields(schema)}
    fields_of["task"] |= {f.name for schema in TASK_SCHEMAS.values() for f in dataclasses.fields(schema)}
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
