"""`headlab reproduce NAME`: the runs behind a paper figure, then the figure from their tables.

A reproduction is a list of `headlab run` override lists plus a drawing function. Runs go to
<output.root>/reproduce/<name>/<run>/; a run dir that is complete with the same config hash is reused,
so an interrupted reproduction continues where it stopped and a finished one only redraws.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from . import results
from .errors import UsageError


@dataclass(frozen=True)
class Reproduction:
    name: str
    paper: str
    runs: Callable[[bool], list[list[str]]]  # quick -> override lists, one per run
    draw: Callable[[pd.DataFrame, Path], dict]  # table, figure dir -> headline numbers
    command: str = "run"  # the headlab command behind each run: run | sae


def registry() -> dict[str, Reproduction]:
    from .figures import attn_sae, count01, markov, recall_reasoning

    return {r.name: r for r in (count01.REPRODUCTION, markov.REPRODUCTION, recall_reasoning.REPRODUCTION,
                                attn_sae.REPRODUCTION)}  # fmt: skip


def get(name: str) -> Reproduction:
    known = registry()
    if name not in known:
        raise UsageError(f"unknown reproduction '{name}'; choose from: {', '.join(sorted(known))}")
    return known[name]


def _slug(overrides: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", ",".join(o.split("/")[-1] for o in overrides))[:150]


def run_all(name: str, root: Path, quick: bool = False, extra: tuple[str, ...] = (), log=print) -> dict:
    from hydra import compose, initialize_config_dir

    from . import pipeline
    from .config import config_dir

    repro = get(name)
    base = root / "reproduce" / (name + ("-quick" if quick else ""))
    runs = repro.runs(quick)
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        for i, overrides in enumerate(runs, 1):
            cfg = compose("config", overrides=[*overrides, f"output.root={root}", *extra])
            run_dir = base / _slug(overrides)
            if pipeline.already_done(cfg, run_dir):
                log(f"[{i}/{len(runs)}] skip (done): {run_dir.name}")
                continue
            log(f"[{i}/{len(runs)}] run: {' '.join(overrides)}")
            {"run": pipeline.run, "sae": pipeline.sae}[repro.command](cfg, run_dir, show_progress=False)
    table = results.collect(base)
    figures = base / "figures"
    figures.mkdir(exist_ok=True)
    numbers = repro.draw(table, figures)
    results.atomic_write_bytes(base / "numbers.json", json.dumps(numbers, indent=2).encode())
    results.atomic_write_bytes(base / "collected.parquet", table.to_parquet(index=False))
    return {"dir": str(base), "figures": sorted(str(p) for p in figures.glob("*.png")), "numbers": numbers}
