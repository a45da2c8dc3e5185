"""One run, start to end: skip it if done, run its study, write its run dir, draw its figures.

A run dir is complete when meta.json exists (results.write puts it last), and its config hash says
which config it holds: a second run of the same config into the same dir returns the stored table. The
hash is the study's cache key (Study.hash: its name and options, what else it reads, CACHE_VERSION).
The figure sets drawn are noted in meta.json once drawn (`figures`): a run stopped between its table and
its figures (a SLURM time limit, a kill), or asked now for a set it lacks, draws them from its table when
it is run again, and is still skipped.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from .. import results
from ..config import Config, option
from ..errors import UsageError
from ..io import atomic_write_bytes
from ..planning import (
    PLANNED,
    Plan,
    budget_for,
    converting,
    converts,
    fitted,
    fitted_passes,
    grown,
    kept_mb,
    measured,
    plan_prompts,
    predict,
    reads_at_once,
    reads_vocabulary,
    rss_mb,
    shape_of_model,
    tokenizer_mb,
    working_mb,
)
from ..train.obtain import is_trained_here
from .atlas_plan import atlas_plan
from .context import EVAL_SEED_OFFSET, RunContext, apply_runtime
from .registry import study_for
from .study import Study

log = logging.getLogger("headlab")


def already_done(cfg: Config, run_dir: Path, command: str = "run", named: str | None = None) -> bool:
    """A complete result for the same config: the job is skipped (resume, idempotent sweeps)."""
    if not results.is_complete(run_dir):
        return False
    study = study_for(command, cfg, named)
    return results.read_meta(run_dir).get("config_hash") == study.hash(cfg)


def previous_result(cfg: Config, run_dir: Path, command: str, named: str | None) -> pd.DataFrame | None:
    """The table of a finished run of this same config (marked skipped), else None."""
    if not already_done(cfg, run_dir, command, named):
        return None
    log.info("skipped: %s holds a complete result for this config", run_dir)
    df = pd.read_parquet(Path(run_dir) / results.TABLE)
    sets = figure_sets(study_for(command, cfg, named), cfg)
    if not set(sets) <= set(results.read_meta(run_dir).get("figures", [])):
        log.info("figures: drawing %s, which %s lacks", ", ".join(sets), run_dir)
        draw_all(sets, df, Path(run_dir))
    df.attrs["skipped"] = True
    return df


def execute_run(
    command: str, cfg: Config, run_dir: Path, show_progress: bool = True, named: str | None = None
) -> pd.DataFrame:
    """`headlab <command>` for one config into run_dir; returns the table (attrs["skipped"] if reused).
    `named`: the study the user named with `study=` (registry.named_study), else None; cfg.study.name is
    set to the study that runs."""
    study = study_for(command, cfg, named)
    check_figures(cfg)  # a finished run draws a set it lacks too
    previous = previous_result(cfg, run_dir, command, named)
    if previous is not None:
        return previous
    threads = apply_runtime(cfg)
    key = study.hash(cfg)  # the config as asked for: a budget's smaller chunks compute the same table
    budget = within_budget(cfg)[0] if cfg.engine.max_memory else None  # before anything loads
    ctx = RunContext(cfg, Path(run_dir), show_progress, options=study.options(cfg), threads=threads)
    ctx.meta["threads"] = threads.as_meta()
    if budget is not None:
        ctx.meta["budget"] = budget
    baseline, started = rss_mb(), time.perf_counter()
    # its plan beside what it measured, each run checking it: a pretrained model's made once it is loaded,
    # before the work, so that the matmul rate is measured on the machine as the run finds it; a model
    # trained here exists only after the run (which refuses a task it cannot train on before training)
    planned = study.name in PLANNED and not is_trained_here(cfg)
    first = planned and converts(cfg)  # asked before loading, which converts a GGUF model's weights once
    plan, planning = _plan_in_run(study.name, ctx, baseline, first) if planned else (None, 0)
    df = study.run(ctx)
    seconds = time.perf_counter() - started - planning
    if study.name in PLANNED and plan is None and ctx.model is not None:
        plan = _plan_in_run(study.name, ctx, baseline)[0]
    if plan is not None:
        ctx.meta.update(plan=plan.as_meta(), measured=measured(plan, seconds))
    results.write(df, run_dir, results.run_meta(key, ctx.timings, {"study": study.name, **ctx.meta}))
    # the model (its mapped weights, a cycle of modules) goes before the figures are drawn: matplotlib then
    # takes the memory it held, and a run under engine.max_memory stays there to its end
    del ctx
    gc.collect()
    draw_all(figure_sets(study, cfg), df, Path(run_dir))
    return df


def figure_sets(study: Study, cfg: Config) -> list[str]:
    """The figure sets a run draws: its study's own, always, and the one output.figures adds."""
    return list(dict.fromkeys(f for f in (study.figures, cfg.output.figures) if f))


def draw_all(sets: list[str], df: pd.DataFrame, run_dir: Path) -> None:
    """Every set of `sets` from the run's table, their numbers merged into one numbers.json (which an
    earlier config's run in this dir must not seed), then noted in meta.json as drawn."""
    if not sets:
        return
    (run_dir / "figures" / "numbers.json").unlink(missing_ok=True)
    for figures in sets:
        draw_figures(figures, df, run_dir)
    results.add_meta(run_dir, figures=sets)


def _plan_in_run(name: str, ctx: RunContext, baseline_mb: float, first: bool = False) -> tuple[Plan, float]:
    """The run's plan on its loaded model and prompts (loaded here, as the study would first), and the
    seconds planning took (not the run's); `first`: the loading converted its GGUF weights (converts)."""
    if name == "atlas":
        model = ctx.get_model(runs_task=False)
        started = time.perf_counter()
        plan = atlas_plan(ctx.cfg, model, baseline_mb)
    else:
        data = ctx.get_data()
        model, started = ctx.get_model(), time.perf_counter()
        task = ctx.get_task()
        plan = predict(
            ctx.cfg,
            shape_of_model(model),
            data,
            reads_at_once(task, data),
            baseline_mb,
            tokenizer_mb(model),
            vocabulary=reads_vocabulary(ctx.cfg, task, data),
        )
    return converting(plan, shape_of_model(model)) if first else plan, time.perf_counter() - started


# what within_budget chooses, by the setting it writes
BUDGET_KNOBS = {
    "chunk_mb": "engine.chunk_mb",
    "prompts_per_pass": "study.prompts_per_pass",
    "curve_prompts": "study.curve_prompts",
    "layers_on_disk": "model.layers_on_disk",
}


def plan_of(cfg: Config) -> Plan:
    """The plan of the run `cfg` asks for, before loading (a pretrained model): an atlas's its probes'
    (atlas_plan.py), else the run's prompts'."""
    from ..tasks import build_task

    if cfg.study.name == "atlas":
        return atlas_plan(cfg)
    return plan_prompts(cfg, build_task(cfg.task), cfg.seed + EVAL_SEED_OFFSET)


def within_budget(cfg: Config) -> tuple[dict, Plan]:
    """engine.max_memory kept: the run's plan made before loading (a pretrained model), engine.chunk_mb lowered
    until the predicted peak fits, the last blocks' weights left on disk where the weights alone do not
    (model.layers_on_disk); refused in one line where even that cannot (planning.fitted). Returns what it
    chose (meta.json `budget`) and the plan that keeps it."""
    if option(cfg.model.kind) != "hf":
        raise UsageError(f"engine.max_memory plans a pretrained model's run; {cfg.model.name} is built here")
    budget = str(cfg.engine.max_memory)
    plan = grown(plan_of(cfg))  # the run loads on top of what planning left in this process
    if plan.convert_mb > kept_mb(budget):
        raise UsageError(
            f"engine.max_memory={budget}: de-quantising {cfg.model.name}'s GGUF weights once first needs "
            f"{budget_for(plan.convert_mb):,}MB: run it once without a budget"
        )
    passes = {}
    if plan.study == "circuit":  # fewer prompts per gradient pass first: the same scores, summed in more parts
        cfg.study.prompts_per_pass, curve_prompts, plan = fitted_passes(plan, int(cfg.study.prompts_per_pass), budget)
        passes = {"prompts_per_pass": cfg.study.prompts_per_pass}
        if curve_prompts is not None and cfg.study.faithfulness:
            cfg.study.curve_prompts = min(curve_prompts, cfg.study.curve_prompts or curve_prompts)
            passes["curve_prompts"] = cfg.study.curve_prompts
    chunk, plan = fitted(plan, cfg.engine.chunk_mb, budget)
    cfg.engine.chunk_mb, cfg.model.layers_on_disk = chunk, plan.layers_on_disk
    if plan.chunked:
        working = working_mb(chunk, plan.logits_mb, plan.copy_mb)
        plan = replace(plan, peak_host_mb=plan.peak_host_mb - plan.working_mb + working, working_mb=working)
    chosen = {
        "max_memory": budget,
        "chunk_mb": round(chunk, 2),
        **passes,
        "layers_on_disk": plan.layers_on_disk,
        "planned_peak_host_mb": round(plan.peak_host_mb, 1),
    }
    return chosen, plan


def run_in_memory(study: Study, ctx: RunContext) -> pd.DataFrame:
    """The study's table in ctx (the Python API's model and task), nothing written."""
    apply_runtime(ctx.cfg)
    ctx.options = study.options(ctx.cfg)
    return study.run(ctx)


def check_figures(cfg: Config) -> None:
    from ..figures import FIGURES

    if cfg.output.figures and cfg.output.figures not in FIGURES:
        raise UsageError(f"unknown figure set '{cfg.output.figures}'; choose from: {', '.join(sorted(FIGURES))}")


def draw_figures(name: str, table: pd.DataFrame, run_dir: Path) -> None:
    """Figures from the run's table into <run_dir>/figures (+ numbers.json); the table stands without them."""
    from ..figures import FIGURES

    numbers = FIGURES[name](table, run_dir / "figures")
    path = run_dir / "figures" / "numbers.json"
    if not numbers and not path.parent.is_dir():
        return  # the set had nothing to draw (the heads set on a layer sweep): no figures folder at all
    if path.exists():  # another set drawn into the same run: its numbers stay beside these
        numbers = {**json.loads(path.read_text()), **numbers}
    atomic_write_bytes(path, json.dumps(numbers, indent=2).encode())
