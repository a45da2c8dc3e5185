"""The `headlab` command: typer commands, Hydra composition, multirun hand-off, exit codes."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .config import GROUPS, Config, config_dir
from .door import expand_short_forms, group_options, launcher_of, typed, validate_overrides
from .errors import HeadlabError, Interrupted, UsageError
from .io import atomic_write_bytes

app = typer.Typer(add_completion=False, help="headlab: experiment runner for attention-head studies.")
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)
log = logging.getLogger("headlab")
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


# ---------------------------------------------------------------- Hydra hand-off


def _hydra_run(overrides: list[str], task_function: Callable) -> None:
    """Hand the overrides to Hydra's own entry point, so launchers, sweeps and run dirs are Hydra's.

    task_function is module-level: submitit pickles it, by reference, to run it in another process."""
    import hydra

    entry = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(task_function)

    from . import multirun

    argv = sys.argv
    sys.argv = ["headlab", *overrides, "--multirun"]
    code = 0
    try:
        entry()
    except SystemExit as e:  # Hydra exits 1 after reporting a failed job; the summary says which
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    sweep_dir = multirun.last_sweep_dir()
    if sweep_dir is not None and sweep_dir.is_dir():
        jobs = multirun.summarize(sweep_dir)
        out.print(
            f"sweep {sweep_dir}: {len(jobs['done'])} done, {len(jobs['skipped'])} skipped, "
            f"{len(jobs['failed'])} failed",
            highlight=False,
            soft_wrap=True,
        )
        if jobs["done"] or jobs["skipped"]:
            out.print(f"heatmaps and tables of all jobs: headlab report {sweep_dir}", highlight=False, soft_wrap=True)
            _compare_models(sweep_dir, jobs)
        for job in jobs["failed"]:
            err.print(
                f"failed: {job['dir']}: {job.get('error')} (log: {job.get('log')})", highlight=False, soft_wrap=True
            )
        code = code or (1 if jobs["failed"] else 0)
    if code:
        raise SystemExit(code)


def _compare_models(sweep_dir: Path, jobs: dict[str, list[dict]]) -> None:
    """A sweep over `model=`: its models side by side (headlab compare), or the command once all jobs ran."""
    from . import compare as comparison

    if len(comparison.swept_models(jobs)) < 2:
        return
    if jobs["failed"]:
        said = f"models side by side, once every job ran: headlab compare {sweep_dir}"
        out.print(said, highlight=False, soft_wrap=True)
        return
    try:
        target, _ = comparison.write(sweep_dir)
    except Exception as e:  # the jobs' results stand: a comparison that fails must not fail the sweep
        out.print(f"models not compared: {e}", highlight=False, soft_wrap=True)
        return
    out.print(f"models side by side (headlab compare): {target / comparison.FIGURE}", highlight=False, soft_wrap=True)


def run_task(cfg: DictConfig) -> str:
    return _job("run", cfg)


def train_task(cfg: DictConfig) -> str:
    return _job("train", cfg)


def sae_task(cfg: DictConfig) -> str:
    return _job("sae", cfg)


def _job(command: str, cfg: DictConfig) -> str:
    """One job of a multirun, wherever the launcher runs it; returns its status (done | skipped)."""
    from hydra.core.hydra_config import HydraConfig

    from .discovery import load_plugins
    from .studies import execute_run
    from .studies.registry import named_study

    load_plugins()  # a launcher's job may run in a process of its own
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        named = named_study(list(hydra_cfg.overrides.task))
        df = execute_run(command, typed(cfg), run_dir, show_progress=False, named=named)
    except HeadlabError as e:
        log.error("%s", e)
        raise
    if df.attrs.get("skipped"):
        return "skipped"
    log.info("results in %s", run_dir)
    return "done"


def _sweep(overrides: list[str], task_function: Callable, command: str) -> None:
    """A multirun: every job's config (and the one study it runs) and the launcher's cluster checked
    here, then Hydra's."""
    from .multirun import check_cluster
    from .studies.registry import named_study, study_for

    overrides = expand_short_forms(overrides)  # Hydra composes each job: the short forms spelled as studies
    raw, cfg = validate_overrides(overrides, lambda job, chosen: study_for(command, job, named_study(chosen)))
    check_cluster(*launcher_of(raw))
    _hydra_run(_with_task_model(overrides, cfg), task_function)


def _with_task_model(overrides: list[str], cfg: Config) -> list[str]:
    """The task's default model where the user named none and the configured one cannot serve it."""
    from .task_models import choose_model

    chosen, note = choose_model(overrides, cfg)
    if note:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    return chosen


def _single(command: str, overrides: list[str]) -> None:
    """One run in this process, through the Python API (headlab.run)."""
    from . import api

    result = api.run(*overrides, command=command, show_progress=sys.stderr.isatty())
    if result.skipped:
        out.print(f"skipped: {result.run_dir} holds a complete result for this config", highlight=False, soft_wrap=True)
    else:
        from .studies import get

        get(result.config.study.name).summary(result.table, result.config.output.print_rows)
    out.print(f"results: {result.run_dir}", highlight=False, soft_wrap=True)
    from .results import read_meta

    meta = read_meta(result.run_dir)  # its threads, and where its weights came from (`weights`)
    if meta.get("threads") and not result.skipped:
        from .runtime import Threads

        out.print(Threads(**meta["threads"]).line(), highlight=False, soft_wrap=True)
    weights = meta.get("weights")
    if weights:
        from .models.loading import describe_weights

        out.print(f"weights: {result.config.model.name} {describe_weights(weights)}", highlight=False, soft_wrap=True)
    page = result.run_dir / "atlas.html"
    if page.is_file():
        out.print(f"atlas: {page}", highlight=False, soft_wrap=True)
    drawn = sorted((result.run_dir / "figures").glob("*.png"))
    if drawn:
        names = ", ".join(p.name for p in drawn)
        out.print(f"figures: {result.run_dir / 'figures'} ({names})", highlight=False, soft_wrap=True)


# ---------------------------------------------------------------- commands


MULTIRUN = typer.Option(False, "-m", "--multirun", help="Sweep: comma-separated values, one job each.")


@app.command(context_settings=PASS_THROUGH)
def run(
    ctx: typer.Context,
    multirun: bool = MULTIRUN,
) -> None:
    """Run an experiment: `headlab run model=... task=... ablate=heads [key=value ...]`."""
    if multirun:
        _sweep(ctx.args, run_task, "run")
    else:
        _single("run", ctx.args)


@app.command(context_settings=PASS_THROUGH)
def train(
    ctx: typer.Context,
    multirun: bool = MULTIRUN,
) -> None:
    """Train a toy model from scratch: `headlab train model=toy-attn-1l task=counting train.steps=2000`."""
    if multirun:
        _sweep(ctx.args, train_task, "train")
    else:
        _single("train", ctx.args)


@app.command(context_settings=PASS_THROUGH)
def sae(
    ctx: typer.Context,
    multirun: bool = MULTIRUN,
) -> None:
    """Fit a sparse autoencoder on one layer's head outputs z: `headlab sae sae=topk sae.layer=1 [key=value ...]`."""
    if multirun:
        _sweep(ctx.args, sae_task, "sae")
    else:
        _single("sae", ctx.args)


@app.command(context_settings=PASS_THROUGH)
def atlas(
    ctx: typer.Context,
    scores: str | None = typer.Option(None, "--scores", help="A subset, comma-separated: e.g. induction,sink."),
) -> None:
    """Every head of a model on one page: `headlab atlas model=smollm2-135m [--scores induction,copy]` writes
    the table of every score and atlas.html (`headlab run study=atlas` is the same)."""
    chosen = [f"++study.scores=[{scores}]"] if scores else []
    _single("run", ["study=atlas", *ctx.args, *chosen])


@app.command(context_settings=PASS_THROUGH)
def check(ctx: typer.Context) -> None:
    """Check that headlab's hooks agree with the model itself: `headlab check model=hf model.path=DIR`."""
    from . import api

    verdicts = api.check(api.compose(*ctx.args), show_progress=sys.stderr.isatty())
    for verdict in verdicts:
        out.print(verdict.line(), highlight=False, soft_wrap=True)
    if not all(v.ok for v in verdicts):
        raise SystemExit(1)


@app.command(context_settings=PASS_THROUGH)
def plan(ctx: typer.Context) -> None:
    """What a run will need, before any weights are read: `headlab plan model=smollm2-135m task=ioi` (an atlas:
    `headlab plan study=atlas model=...`)."""
    from . import api

    for line in api.plan(*ctx.args).lines():
        out.print(line, highlight=False, soft_wrap=True)


@app.command("list")
def list_(group: str | None = typer.Argument(None, help="One of: " + ", ".join(GROUPS))) -> None:
    """List config groups and their options."""
    if group is not None and group not in GROUPS:
        raise UsageError(f"unknown group '{group}'; choose from: {', '.join(GROUPS)}")
    for g in [group] if group else GROUPS:
        out.print(f"[bold]{g}[/bold]")
        for name in group_options(g):
            out.print(f"  {name:<20} {_describe(g, name)}", highlight=False)


def _describe(group: str, name: str) -> str:
    if group == "study":  # the Study record is the one place that describes a study
        from .studies.registry import studies

        found = studies().get(name)
        return found.description if found else "(no study of this name is registered: studies/registry.py)"
    path = config_dir() / group / f"{name}.yaml"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith("#") and "@package" not in line:
                return line.lstrip("# ").strip()
    return ""


@app.command()
def collect(
    directory: Path = typer.Argument(..., help="A multirun directory (or any directory of run dirs)."),
    output: Path | None = typer.Option(None, "--out", "-o", help="Table path (default DIR/collected.parquet)."),
) -> None:
    """Concatenate the result tables of every run below DIR into one parquet + csv."""
    from . import results

    df = results.collect(directory)
    target = output or directory / "collected.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, df.to_parquet(index=False))
    atomic_write_bytes(target.with_suffix(".csv"), df.to_csv(index=False).encode())
    out.print(f"{len(df)} rows from {df['run_dir'].nunique()} runs -> {target}", highlight=False, soft_wrap=True)


@app.command()
def compare(
    directory: Path = typer.Argument(..., help="A sweep over model= (or any directory of runs of one study)."),
    output: Path | None = typer.Option(None, "--out", "-o", help="Output dir (default DIR/compare)."),
) -> None:
    """The same study on several models side by side, head class by head class: one row per model and class
    in compare.parquet + csv, and compare.png."""
    from . import compare as comparison

    target, compared = comparison.write(directory, output)
    shown = Table(title=f"{compared['study'].iloc[0]}: heads per class (share of the model's heads), mean depth")
    wide = comparison.side_by_side(compared)
    shown.add_column("class")
    for model in wide.columns:
        shown.add_column(str(model), justify="right")
    for cls, cells in wide.iterrows():
        shown.add_row(Text(str(cls)), *(Text(str(c)) for c in cells))
    out.print(shown)
    out.print(f"compare.parquet, compare.csv, compare.png: {target}", highlight=False, soft_wrap=True)


@app.command(context_settings=PASS_THROUGH)
def audit(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="A circuit run (its circuit.json) or an ioi_classes run (its heads)."),
) -> None:
    """Is it *the* circuit? `headlab audit RUN_DIR [key=value ...]`: stability, disjoint rivals and Shi et
    al.'s hypothesis tests for the run's circuit, on its model and task (`headlab run study=audit` alike)."""
    from .studies.audit_sources import audit_overrides

    _single("run", [*audit_overrides(run_dir), *ctx.args])


@app.command()
def reuse(
    first: Path = typer.Argument(..., help="A head sweep or circuit: run dir, sweep dir or results.parquet."),
    second: Path = typer.Argument(..., help="The other task's, on a model of the same shape."),
    k: int = typer.Option(10, "--k", help="Important heads of a sweep: its k of largest |effect|."),
    metric: str | None = typer.Option(None, "--metric", help="The metric (of both, unless --metric-second)."),
    metric_second: str | None = typer.Option(None, "--metric-second", help="The second table's metric."),
    panel: str | None = typer.Option(None, "--panel", help="e.g. 'ablate_head zero' where a table has several."),
    panel_second: str | None = typer.Option(None, "--panel-second", help="The second table's panel."),
    output: Path | None = typer.Option(None, "--out", "-o", help="Run dir (default outputs/reuse/<time>)."),
) -> None:
    """Circuit reuse: the overlap of two tasks' important heads (or circuits), a table and reuse.png."""
    import time

    from . import api, results
    from .studies.runner import draw_figures

    table = api.reuse(first, second, k, metric, metric_second, panel, panel_second)
    run_dir = output or Path("outputs") / "reuse" / time.strftime("%Y-%m-%d/%H-%M-%S")
    results.write(table, run_dir, results.run_meta("", {}, {"first": str(first), "second": str(second), "k": k}))
    draw_figures("reuse", table, run_dir)
    summary = table[table["intervention"] == "reuse"]
    shown = Table(title=str(summary["label"].iloc[0]).replace(" | ", "  vs  "))
    shown.add_column("quantity")
    shown.add_column("value", justify="right")
    for name, value in zip(summary["metric"], summary["value"]):
        shown.add_row(str(name), f"{value:.4g}")
    out.print(shown)
    out.print(f"table and figures/reuse.png: {run_dir}", highlight=False, soft_wrap=True)


@app.command()
def reproduce(
    name: str | None = typer.Argument(None, help="A paper figure (see --list)."),
    list_all: bool = typer.Option(False, "--list", help="Name the reproductions and their papers."),
    quick: bool = typer.Option(False, "--quick", help="Fewer models, seeds and steps: a smoke test."),
    root: Path = typer.Option(Path("outputs"), "--root", help="Output root (checkpoints are cached here)."),
    overrides: list[str] = typer.Argument(
        None, help="Overrides that end every run, e.g. model.tokenizer=<dir> offline (they change run hashes)."
    ),
) -> None:
    """Rebuild a paper's figure from scratch: train what is not trained, run, draw, print the numbers."""
    from . import reproduce as repro

    if list_all or name is None:
        for r in repro.registry().values():
            out.print(f"  {r.name:<16} {r.paper}", highlight=False)
        return
    result = repro.run_all(
        name, root.resolve(), quick=quick, extra=tuple(overrides or ()), log=lambda m: out.print(m, highlight=False)
    )
    table = Table(title=f"{name}: headline numbers")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in _flatten(result["numbers"]).items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        table.add_row(key, Text(shown))  # Text: a context's [[token]] is data, not rich markup
    out.print(table)
    for path in result["figures"]:
        out.print(f"figure: {path}", highlight=False, soft_wrap=True)


def _flatten(numbers: dict, prefix: str = "") -> dict:
    flat: dict[str, Any] = {}
    for key, value in numbers.items():
        name = f"{prefix}{key}"
        flat.update(_flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return flat


@app.command()
def report(directory: Path = typer.Argument(..., help="A run dir, a sweep dir or a reproduction dir.")) -> None:
    """Write DIR/report.html: head heatmaps, top heads, figures, job status, a sortable table, timings and
    configs in one self-contained file."""
    from . import report as report_module

    target = report_module.write(directory)
    out.print(f"report: {target}", highlight=False, soft_wrap=True)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# typer's exit code for a KeyboardInterrupt it caught itself (returned, not raised, with standalone_mode=False)
TYPER_INTERRUPT_CODE = 130


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted in the main thread while the command runs; the handlers in place
    before are put back after, since tests run main() inside their own process."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal refuses other threads
        yield
        return
    # one ignored on entry stays ignored: a script's `headlab ... &` ignores SIGINT, so that Ctrl-C on the
    # script spares it
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    previous = {signum: handler for signum, handler in previous.items() if handler != signal.SIG_IGN}

    def stop(signum: int, frame: object) -> None:
        # a second signal ends the process at once, for a cleanup that hangs
        for each in previous:
            signal.signal(each, signal.SIG_DFL)
        raise Interrupted(signum)

    for signum in previous:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed outside Python, cannot be put back from here
                signal.signal(signum, handler)


def _abort(reason: str, code: int) -> NoReturn:
    err.print(f"aborted: {reason}", highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    try:
        with stop_on_signals():
            from .discovery import load_plugins

            load_plugins()
            code = app(standalone_mode=False)
    except HeadlabError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Interrupted as e:
        _abort(str(e), e.exit_code)
    except typer.Abort:  # typer's answer to an EOFError (a prompt read past the end of its input)
        _abort("end of input", 130)
    except Exception as e:  # click's own usage errors carry an exit code
        code = getattr(e, "exit_code", None)
        if code is None:
            raise
        if hasattr(e, "show"):
            e.show()
        sys.exit(code)
    if code == TYPER_INTERRUPT_CODE:
        _abort("interrupted (SIGINT)", code)
    if isinstance(code, int) and code:
        sys.exit(code)
