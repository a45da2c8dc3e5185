"""The door: every option of every config group, given a wrong type or a value out of range, stops
`headlab run` with exit code 2 and one short line that names the option, before anything is written."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import tempfile
import types
import typing
from enum import Enum
from functools import cache
from pathlib import Path

import pytest
import torch
from hydra.core.config_store import ConfigStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from conftest import error_line, run_headlab
from headlab import config_rules, multirun
from headlab.config import GROUPS, Config, config_dir
from headlab.config_rules import Each, Known, Matches, OneOf, Range, rule_for
from headlab.door import compose, group_options, launcher_of, validate_overrides
from headlab.errors import UsageError

# numeric options that take any value of their type: seeds, and targets a metric is compared with
UNBOUNDED = {"world_seed", "head_seed", "target_value"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One option as a user sets it: the group choice that brings it in, its key, its type and rule."""

    choice: tuple[str, ...]
    key: str
    hint: typing.Any
    rule: typing.Any


def fields_of(schema: type, prefix: str, choice: tuple[str, ...]) -> list[Option]:
    hints = typing.get_type_hints(schema)
    return [
        Option(choice, prefix + f.name, hints[f.name], config_rules.rule_for(schema, f.name))
        for f in dataclasses.fields(schema)
        if not dataclasses.is_dataclass(hints[f.name])
    ]


# options a choice cannot run without (their defaults are refused at the door): set, so that each other
# option's refusal is the one a case sees (a case for the option itself sets it again, after them)
NEEDED = {"study=head_attribution": ("study.heads=[L0H0]",)}


@cache
def every_option() -> tuple[Option, ...]:
    """Every field of every option of every config group (a group config.py adds later included), and the
    top-level options and sections that are no group (engine, output, seed, device, ...)."""
    found, default = fields_of(Config, "", ()), compose()
    for f in dataclasses.fields(Config):
        section = getattr(default, f.name)
        if f.name not in GROUPS and dataclasses.is_dataclass(section):
            found += fields_of(type(section), f"{f.name}.", ())
    for group in GROUPS:
        for name in group_options(group):
            schema = schema_of(group, name)
            if schema is not None:  # experiment=...: a preset of the other groups' options, no schema
                choice = (f"{group}={name}", *NEEDED.get(f"{group}={name}", ()))
                found += fields_of(schema, f"{group}.", choice)
    return tuple(found)


def schema_of(group: str, name: str) -> type | None:
    """The dataclass an option file merges into: the `base_*` schema its defaults name (read from the
    file and Hydra's ConfigStore: composing every option would cost seconds), else its composed section."""
    defaults = OmegaConf.load(config_dir() / group / f"{name}.yaml").get("defaults", [])
    bases = [d.split("@")[0] for d in defaults if isinstance(d, str) and d.startswith("base_")]
    if bases:
        return OmegaConf.get_type(ConfigStore.instance().load(f"{group}/{bases[0]}.yaml").node)
    section = getattr(compose([f"{group}={name}"]), group, None)
    return type(section) if dataclasses.is_dataclass(section) else None


def unwrapped(hint: typing.Any) -> typing.Any:
    """X of an optional X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def wrong_types(hint: typing.Any) -> list[str]:
    hint = unwrapped(hint)
    origin = typing.get_origin(hint)
    if origin is list:
        return ["abc", "3"]
    if origin is dict:
        return ["abc", "[1,2]"]
    if hint is bool:
        return ["maybe", "[1]"]
    if hint is int:
        return ["abc", "1.5", "[1]"]
    if hint is float:
        return ["abc", "[1.0]"]
    if isinstance(hint, type) and issubclass(hint, Enum):
        return ["no_such_member", "[1]"]
    return ["[1,2]", "{a:1}"]  # str


def out_of_range(rule: typing.Any, key: str) -> st.SearchStrategy[str]:
    if key == "device":  # no rule of the table: torch says which devices this machine has
        return st.sampled_from(["foo", "cuda:99", "gpu"])
    if isinstance(rule, Each):
        return out_of_range(rule.rule, key).map(lambda v: f"[[{v}]]" if key == "model.heads" else f"[{v}]")
    if isinstance(rule, (OneOf, Known)):  # a word from a fixed list, or from a registry (circuit methods)
        return st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda w: not rule.accepts(w))
    if isinstance(rule, Matches):
        return st.sampled_from(["1x", "a/b", "x.y", "@@"]).filter(lambda w: not rule.accepts(w))
    assert isinstance(rule, Range), rule
    below = []
    if rule.low is not None and rule.integer:
        below.append(st.integers(-(10**6), int(rule.low) - (0 if rule.low_open else 1)))
    elif rule.low is not None:
        below.append(st.floats(-1e6, rule.low, exclude_max=not rule.low_open, allow_nan=False))
    if rule.high is not None:
        below.append(st.floats(rule.high, 1e6, exclude_min=not rule.high_open, allow_nan=False))
    return st.one_of(below).map(repr)


@st.composite
def bad_option(draw: st.DrawFn) -> tuple[Option, str]:
    option = draw(st.sampled_from(every_option()))
    ranged = option.rule is not None or option.key == "device"
    kinds = ["type", "range"] if ranged else ["type"]
    if draw(st.sampled_from(kinds)) == "type":
        return option, draw(st.sampled_from(wrong_types(option.hint)))
    return option, draw(out_of_range(option.rule, option.key))


def refused(args: list[str], named: str) -> str:
    """`headlab run ARGS` in a fresh dir: exit 2, one line under 200 characters naming `named`, nothing written."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "out"
        proc = run_headlab("run", *args, f"output.root={root}", cwd=Path(tmp))
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        line = error_line(proc)
        assert len(line) < 200 and named in line, (args, line)
        assert not root.exists() and not (Path(tmp) / "outputs").exists(), args
        return line


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_option())
def test_every_option_of_every_group_refuses_a_wrong_type_or_range_in_one_line(case):
    option, value = case
    refused([*option.choice, f"{option.key}={value}"], option.key)


def test_the_walk_covers_every_group_and_every_number_has_a_range():
    options = every_option()
    walked = {o.choice[0].split("=")[0] for o in options if o.choice}
    assert walked == {g for g in GROUPS if g != "experiment"}
    unranged = {
        o.key
        for o in options
        if unwrapped(o.hint) in (int, float) and o.rule is None and o.key.split(".")[-1] not in UNBOUNDED
    }
    assert not unranged, f"numeric options without a rule (config_rules.setting): {sorted(unranged)}"


def test_the_words_of_the_table_are_those_the_code_knows():
    from headlab.interventions.options import PatchConfig
    from headlab.models.hooked import DTYPES
    from headlab.models.pathnet import HEAD_KINDS, PathNetConfig
    from headlab.tasks.formats import FORMATS
    from headlab.tasks.prompts import MULTI_TOKEN, PromptsConfig
    from headlab.vocabulary import HEAD_SITES

    assert config_rules.DTYPES == DTYPES
    assert config_rules.PROMPT_FORMATS == ("auto", *FORMATS)
    assert rule_for(PromptsConfig, "multi_token") == OneOf(MULTI_TOKEN)
    assert rule_for(PathNetConfig, "heads") == Each(OneOf(HEAD_KINDS))
    assert rule_for(PatchConfig, "sites") == Each(OneOf(tuple(str(s) for s in HEAD_SITES)))


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_count_of_prompts_below_one_is_refused(value):
    line = refused([f"task.n_prompts={value}"], "task.n_prompts")
    assert line.endswith(f"task.n_prompts={value}: expected an integer >= 1")


def test_a_position_past_the_longest_prompt_or_a_role_the_task_lacks_is_refused_before_training():
    line = refused(["task=counting", "patch=activation", "patch.positions=[999]"], "patch.positions")
    assert "patch.positions=999: expected an index in [-27, 26]" in line
    line = refused(["task=counting", "patch=activation", "patch.positions=[all,END]"], "patch.positions")
    assert "patch.positions=END: expected all, an index, or a role task counting names: SEP, Y" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device=cuda is accepted")
def test_device_cuda_without_cuda_is_refused():
    assert refused(["device=cuda"], "device").endswith("device=cuda: expected a device torch can use here: cpu")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS: device=mps is accepted")
def test_device_mps_without_mps_is_refused():
    assert "device=mps: expected a device torch can use here: cpu" in refused(["device=mps"], "device")


def test_an_unknown_ablation_method_lists_the_accepted_ones():
    assert "ablate.method" in refused(["ablate.method=foo"], "expected one of zero, mean, resample")


def test_a_sweep_value_out_of_range_is_refused_before_any_job():
    refused(["-m", "task.n_prompts=64,-1"], "task.n_prompts=-1")


def fake_sinfo(directory: Path, body: str) -> dict[str, str]:
    """An environment whose PATH has only `directory` (plus the shell's own tools) and a sinfo there."""
    script = directory / "sinfo"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{directory}:/bin:/usr/bin", "HYDRA_FULL_ERROR": "0"}


@pytest.mark.parametrize("launcher", ["slurm_cpu", "submitit_slurm"])
def test_a_slurm_sweep_whose_controller_cannot_be_reached_is_refused_in_one_line(launcher, tmp_path):
    no_sinfo = {**os.environ, "PATH": str(tmp_path), "HYDRA_FULL_ERROR": "0"}
    args = ["-m", f"hydra/launcher={launcher}", "seed=0,1", "device=cuda", f"output.root={tmp_path / 'out'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "headlab", "run", *args],
        cwd=tmp_path,
        env=no_sinfo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    # the jobs' device is the cluster's to check: the line is about the launcher
    assert f"hydra/launcher={launcher}: the SLURM controller cannot be reached: sinfo is not on PATH" in lines[0]
    assert len(lines[0]) < 200 and not (tmp_path / "out").exists() and not (tmp_path / "outputs").exists()


def test_a_controller_that_fails_or_hangs_is_named_with_what_failed(tmp_path, monkeypatch):
    raw, _ = validate_overrides(["hydra/launcher=slurm_gpu", "device=cuda"])
    assert launcher_of(raw) == ("slurm_gpu", "slurm")
    monkeypatch.setenv(
        "PATH", fake_sinfo(tmp_path, "echo 'sinfo: error: Unable to contact slurm controller' >&2; exit 1")["PATH"]
    )
    with pytest.raises(
        UsageError, match="slurm_gpu: the SLURM controller cannot be reached: sinfo failed: sinfo: error"
    ):
        multirun.check_cluster(*launcher_of(raw))
    fake_sinfo(tmp_path, "exec sleep 30")
    monkeypatch.setattr(multirun, "CLUSTER_TIMEOUT_S", 0.5)
    with pytest.raises(UsageError, match="sinfo did not answer within 0.5 s"):
        multirun.check_cluster(*launcher_of(raw))
    fake_sinfo(tmp_path, "echo debug")
    multirun.check_cluster(*launcher_of(raw))  # a controller that answers: the sweep goes on
    assert launcher_of(validate_overrides(["seed=0,1"])[0])[1] == ""  # the basic launcher probes nothing


def test_a_job_that_hydra_runs_composes_further_configs_and_keeps_its_own():
    """A multirun's job runs inside Hydra's initialized GlobalHydra; a study that composes more configs in
    it (the atlas's probes) must not fail there, and the job's Hydra is the same after."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from headlab.config import config_dir
    from headlab.door import compose, group_options

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        group_options.cache_clear()
        assert "gemma3-270m" in group_options("model")
        assert compose(["model=hf", "model.path=/data/my-model"]).model.name == "my-model"
        assert GlobalHydra.instance().is_initialized()
        assert "gemma3-270m" in GlobalHydra.instance().config_loader().get_group_options("model")
