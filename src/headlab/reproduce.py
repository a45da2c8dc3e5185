"""`headlab reproduce NAME`: the runs behind a paper figure, then the figure from their tables.

Each reproduction is a file configs/reproduce/<name>.yaml:

    paper: <citation>                  shown by `headlab reproduce --list`
    model: <model config name>         optional: the model that {model} in a run stands for;
                                       `headlab reproduce NAME model=X` runs those runs on X instead,
                                       into <output.root>/reproduce/NAME-X/
    command: run                       the headlab command behind each run: run | sae
    figures: <set>                     the figure set (headlab.figures.FIGURES) drawn from the runs' table
    runs:                              in this order, each item one run or a grid block:
      - experiment=a model.width=30      one run: overrides as on the command line (split like a shell)
      - grid: {h: [1, 2], seed: [0]}     a grid block: at each point of the cartesian product of these
        runs:                            values (first variable outermost), these runs in order, with
          - experiment=b model.n_heads={h}      {h} replaced by the point's value of h
          - {run: experiment=c, unless: {h: 1}}     a run left out at the points where h is 1
          - {run: model.path={GPT2}, env: GPT2}     a run only where the environment variable GPT2 is
                                                    set (non-empty), {GPT2} replaced by its value
          - study=audit study.circuit={previous}    {previous}: the run dir of the run before it
        append: seed={seed}              overrides that end each of the block's runs
    quick:                             `--quick`: the runs above, except where these say (each optional)
      runs: [...]                        these runs instead of the full ones
      grid: {h: [1]}                     these values for the variables of these names, in every block
      append: train.steps=100            overrides that end every run

A run holding {var} goes in a block list (`- ...`) or in quotes: inside [...] YAML reads `{` as a mapping.

Runs go to <output.root>/reproduce/<name>/<run>/; a run dir that is complete with the same config hash is reused,
so an interrupted reproduction continues where it stopped and a finished one only redraws.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from . import results
from .config import config_dir
from .door import compose
from .errors import HeadlabError, UsageError
from .figures import FIGURES
from .io import atomic_write_bytes

COMMANDS = ("run", "sae")  # the headlab commands a reproduction's runs can be
PREVIOUS = "previous"  # {previous} in a run: the run dir of the run before it


@dataclass(frozen=True)
class Reproduction:
    name: str
    paper: str
    command: str  # one of COMMANDS
    figures: str  # a key of FIGURES
    full: list[list[str]]  # override lists, one per run, on the reproduction's own model
    quick: list[list[str]]
    model: str | None = None  # what {model} in a run stands for, where the file names one
    spec: Any = None  # the file's runs and quick sections, to expand again for another model

    def runs(self, quick: bool, model: str | None = None) -> list[list[str]]:
        if model is None or model == self.model:
            return self.quick if quick else self.full
        if self.model is None:
            raise UsageError(f"reproduction {self.name} runs on the models it names: it takes no model=")
        return _expanded(self.spec, quick, {"model": model})


def registry() -> dict[str, Reproduction]:
    return {r.name: r for r in map(load, sorted((config_dir() / "reproduce").glob("*.yaml")))}


def get(name: str) -> Reproduction:
    known = registry()
    if name not in known:
        raise UsageError(f"unknown reproduction '{name}'; choose from: {', '.join(sorted(known))}")
    return known[name]


def load(path: Path) -> Reproduction:
    """The reproduction a YAML file declares, both run lists expanded, so a mistake in it shows at once."""
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # the YAML parser's errors share no base class short of Exception
        raise HeadlabError(f"{path}: not readable as YAML: {' '.join(str(e).split())}") from e
    try:
        spec = _mapping(raw, "the file")
        required = frozenset({"paper", "command", "figures", "runs"})
        _check_keys(spec, {*required, "quick", "model"}, "the file", required)
        if not isinstance(spec["paper"], str):
            raise ValueError("paper: must be a string")
        if spec["command"] not in COMMANDS:
            raise ValueError(f"command: must be one of {', '.join(COMMANDS)}")
        if spec["figures"] not in FIGURES:
            raise ValueError(f"figures: must be one of {', '.join(sorted(FIGURES))}")
        _check_keys(spec.get("quick") or {}, {"runs", "grid", "append"}, "quick")
        model = spec.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError("model: must be a model config's name")
        fixed = {"model": model} if model else {}
        full, short = _expanded(spec, False, fixed), _expanded(spec, True, fixed)
    except ValueError as e:
        raise HeadlabError(f"{path}: {e}") from e
    return Reproduction(path.stem, spec["paper"], spec["command"], spec["figures"], full, short, model, spec)


def _expanded(spec: dict, quick: bool, fixed: dict[str, Any]) -> list[list[str]]:
    if not quick:
        return expand(spec["runs"], fixed=fixed)
    short = spec.get("quick") or {}
    return expand(short.get("runs", spec["runs"]), short.get("grid", {}), short.get("append", ""), fixed)


def expand(items: Any, values: Any = None, append: Any = "", fixed: dict[str, Any] | None = None) -> list[list[str]]:
    """The override lists a `runs:` list stands for; `values` replace the grid variables' values of those
    names and `append` ends every run (as `quick:` asks); `fixed` are variables every run sees (the
    reproduction's model). ValueError says what is malformed."""
    values = _grid(values or {}, "quick: grid")
    replaced: set[str] = set()
    out = []
    for item in _sequence(items, "runs"):
        block = item if isinstance(item, dict) else {"runs": [item]}
        _check_keys(block, {"grid", "runs", "append"}, "a grid block", frozenset({"runs"}))
        grid = _grid(block.get("grid", {}), "grid")
        replaced |= grid.keys() & values.keys()
        grid |= {k: v for k, v in values.items() if k in grid}
        for point in itertools.product(*grid.values()):
            env = {**(fixed or {}), **dict(zip(grid, point))}
            for run in _sequence(block["runs"], "a grid block's runs"):
                run = run if isinstance(run, dict) else {"run": run}
                _check_keys(run, {"run", "unless", "env"}, "a run", frozenset({"run"}))
                if _left_out(run.get("unless", {}), env):
                    continue
                local = dict(env)
                if "env" in run:
                    local[str(run["env"])] = os.environ.get(str(run["env"]), "")
                    if not local[str(run["env"])]:
                        continue
                line = [*_split(run["run"]), *_split(block.get("append", "")), *_split(append)]
                out.append([_fill(token, local) for token in line])
    if values.keys() - replaced:
        raise ValueError(f"quick: grid names {', '.join(sorted(values.keys() - replaced))}, in no grid block")
    if not out:
        raise ValueError("runs: expands to no run")
    return out


def model_override(extra: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """The model a `model=X` among a reproduction's overrides names (its runs' {model}), and the rest."""
    chosen = [o.split("=", 1)[1] for o in extra if o.startswith("model=")]
    if len(chosen) > 1:
        raise UsageError(f"one model= per reproduction, not {', '.join(chosen)}")
    return (chosen[0] if chosen else None), tuple(o for o in extra if not o.startswith("model="))


def provenance(name: str, quick: bool, extra: tuple[str, ...], base: Path, runs: list[list[str]]) -> dict:
    """What made a numbers file: the command, the commit, the machine, and each run's own seconds and torch
    threads (as its meta.json holds them, however long ago it ran; a reused run is not timed again)."""
    seconds, threads = {}, {}
    for overrides in runs:
        meta = base / _slug(overrides) / results.META
        if meta.is_file():
            stored = json.loads(meta.read_text())
            seconds[" ".join(overrides)] = round(sum(stored.get("seconds", {}).values()), 1)
            if "threads" in stored:
                threads[" ".join(overrides)] = stored["threads"]["threads"]
    return {
        "command": " ".join(["headlab reproduce", name, *(["--quick"] if quick else []), *extra]),
        "git_commit": results.git_commit(),
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "run_seconds": seconds,
        "run_threads": threads,
    }


def _mapping(spec: Any, what: str) -> dict:
    if not isinstance(spec, dict):
        raise ValueError(f"{what}: must be a mapping")
    return spec


def _check_keys(spec: Any, allowed: set[str], what: str, required: frozenset[str] = frozenset()) -> None:
    unknown, missing = _mapping(spec, what).keys() - allowed, required - spec.keys()
    if unknown:
        raise ValueError(
            f"{what}: unknown key {', '.join(sorted(map(str, unknown)))}; known: {', '.join(sorted(allowed))}"
        )
    if missing:
        raise ValueError(f"{what}: missing {', '.join(sorted(missing))}")


def _sequence(items: Any, what: str) -> list:
    if not isinstance(items, list) or not items:
        raise ValueError(f"{what}: must be a non-empty list")
    return items


def _grid(grid: Any, what: str) -> dict[str, list]:
    for name, values in _mapping(grid, what).items():
        if not re.fullmatch(r"\w+", str(name)):
            raise ValueError(f"{what}: variable '{name}' must be a word")
        if not isinstance(values, list) or not values or not all(_is_scalar(v) for v in values):
            raise ValueError(f"{what}: {name} must be a non-empty list of scalars")
    return dict(grid)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _text(value: Any) -> str:
    """A value as an override writes it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _left_out(unless: Any, env: dict[str, Any]) -> bool:
    _check_keys(unless, set(env), "unless (grid variables only)")
    return bool(unless) and all(_text(env[k]) == _text(v) for k, v in unless.items())


def _split(line: Any) -> list[str]:
    if not isinstance(line, str):
        raise ValueError(f"{line!r}: a run must be a line of overrides")
    return shlex.split(line)


def _fill(token: str, env: dict[str, Any]) -> str:
    def value(match: re.Match) -> str:
        if match[1] == PREVIOUS:  # filled in when the runs run (run_all)
            return match[0]
        if match[1] not in env:
            raise ValueError(f"{token}: {{{match[1]}}} is no grid variable here")
        return _text(env[match[1]])

    return re.sub(r"\{(\w+)\}", value, token)


def _slug(overrides: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", ",".join(o.split("/")[-1] for o in overrides))[:150]


def run_all(
    name: str, root: Path, quick: bool = False, extra: tuple[str, ...] = (), log: Callable[[str], object] = print
) -> dict:
    from .studies import already_done, execute_run
    from .studies.registry import named_study

    repro = get(name)
    model, extra = model_override(extra)
    on = f"-{model}" if model and model != repro.model else ""
    base = root / "reproduce" / (name + on + ("-quick" if quick else ""))
    runs = repro.runs(quick, model)
    for i, written in enumerate(runs, 1):
        run_dir = base / _slug(written)
        # quoted: a run dir's name holds '=', which Hydra reads unquoted as the next override
        before = f"'{(base / _slug(runs[i - 2])).resolve()}'" if i > 1 else "{previous}"
        overrides = [o.replace("{" + PREVIOUS + "}", before) for o in written]
        cfg = compose([*overrides, f"output.root={root}", *extra])
        named = named_study([*overrides, *extra])
        done = already_done(cfg, run_dir, repro.command, named)
        log(f"[{i}/{len(runs)}] " + (f"skip (done): {run_dir.name}" if done else f"run: {' '.join(overrides)}"))
        # a finished run is not run again: it draws only the figure sets it lacks (stopped before them)
        execute_run(repro.command, cfg, run_dir, show_progress=False, named=named)
    table = results.collect(base)
    figures = base / "figures"
    figures.mkdir(exist_ok=True)
    numbers = FIGURES[repro.figures](table, figures)
    numbers["provenance"] = provenance(name, quick, (*([f"model={model}"] if model else []), *extra), base, runs)
    atomic_write_bytes(base / "numbers.json", json.dumps(numbers, indent=2).encode())
    atomic_write_bytes(base / "collected.parquet", table.to_parquet(index=False))
    return {"dir": str(base), "figures": sorted(str(p) for p in figures.rglob("*.png")), "numbers": numbers}
