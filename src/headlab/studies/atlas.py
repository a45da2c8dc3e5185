"""`headlab atlas model=...` (`headlab run study=atlas`): every head of a model on one page.

Each score comes from the study that owns it, run as its own `headlab run` would run it (atlas_probes.py),
on one loaded model; its table is cached under output.root/atlas/<model>/<probe>-<that study's config
hash>/, so a second atlas with another score runs only that score's probe. Attention entropy and distance
and the heads' cards (an example pattern, the tokens each head attends to and writes most) are the
atlas's own probe, on the text (analysis/attention_stats.py). Labels follow atlas_rules.py.

Rows: intervention "none", method "score", one per head and atlas score (metric), with its 95% interval
where the score has one, `rank` among the heads (1: the largest, by magnitude for the ablation effects),
`probe`, `partner` (composition), `label` and `rule` where the score passes a class's rule. The run dir
also holds atlas.html (report/atlas_page.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from .. import results
from ..config import Config, option, run_info
from ..errors import HeadlabError, UsageError
from ..io import atomic_write_bytes
from ..models.hooked import HookedModel
from ..report.atlas_page import page
from ..tables import head_name
from ..tasks import build_task
from .atlas_attribution import atlas_probe as attribution_probe
from .atlas_cards import attention_probe
from .atlas_probes import AtlasOptions, Probe, cache_dir, left_out, partners, probe_config, probes, rules, scores
from .atlas_rules import labelled, rule_texts
from .context import RunContext
from .study import Study
from .summary import console, head_table

BY_MAGNITUDE = ("ioi_logit_diff_change", "text_loss_increase")  # ranked by |value|: either sign matters
PAGE = "atlas.html"


def chosen_scores(options: AtlasOptions) -> list[str]:
    known = list(scores())
    unknown = [s for s in options.scores if s not in known]
    if unknown:
        raise UsageError(f"atlas: unknown score {unknown[0]!r}; choose from: {', '.join(known)}")
    return list(options.scores) or known


def run_probe(ctx: RunContext, model: HookedModel, probe: Probe, options: AtlasOptions) -> tuple[pd.DataFrame, str]:
    """The probe's study table (from the cache where that study's hash matches), and the task it ran on."""
    cfg = probe_config(ctx.cfg, probe.overrides(options))
    study = probe.study
    key = study.hash(cfg)
    where = cache_dir(ctx.cfg, probe.name, key)
    cached = results.is_complete(where) and results.read_meta(where).get("config_hash") == key
    ctx.meta.setdefault("probes", {})[probe.name] = {"dir": str(where), "cached": cached}
    if cached:  # conformed: a table cached before the hook column has none
        return results.conform(pd.read_parquet(where / results.TABLE)), cfg.task.name
    inner = RunContext(cfg, where, ctx.show_progress, task=build_task(cfg.task), model=model)
    inner.options = study.options(cfg)
    with ctx.timed(probe.name):
        table = study.run(inner)
    results.write(table, where, results.run_meta(key, inner.timings, {"study": study.name, **inner.meta}))
    ctx.meta["probes"][probe.name]["seconds"] = round(sum(inner.timings.values()), 1)
    return table, cfg.task.name


def ranked(rows: pd.DataFrame) -> pd.DataFrame:
    key = rows["value"].where(~rows["metric"].isin(BY_MAGNITUDE), rows["value"].abs())
    rows = rows.assign(rank=key.groupby(rows["metric"]).rank(ascending=False, method="min"))
    return rows.astype({"rank": "Int64"})


def fitted(options: AtlasOptions, cfg: Config) -> AtlasOptions:
    """The options a toy model allows: BOS and two copies of the repeat within n_ctx."""
    if option(cfg.model.kind) != "toy":
        return options
    return dataclasses.replace(options, repeat_len=min(options.repeat_len, (cfg.model.n_ctx - 1) // 2))


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, options = ctx.cfg, fitted(ctx.options or AtlasOptions(), ctx.cfg)
    wanted = chosen_scores(options)
    model = ctx.get_model(runs_task=False)
    model.place(cfg.device)
    with ctx.timed("attention"):  # first: the cheap probes before the ablations, which take most of the time
        attention, cards = attention_probe(ctx, model, options, {"entropy", "distance"} & set(wanted))
    with ctx.timed("attribution"):  # each head's typical edge split over its upstream components, and MAPS
        cards = {**cards, **attribution_probe(ctx, model, options)}
    frames, links = [attention], {}
    for probe in probes():
        mine = [s for s in probe.scores if s.name in wanted]
        if not mine:
            continue
        why = left_out(probe, model.name, model.tokenizer is not None, model.n_layers)
        if why:
            ctx.note(why)
            continue
        try:
            table, task = run_probe(ctx, model, probe, options)
        except UsageError:
            raise
        except HeadlabError as e:  # the study ran and found nothing to score (needle_copy: no needle recalled)
            ctx.note(f"atlas: {', '.join(s.name for s in probe.scores)} left out: {e}")
            continue
        rows = probe.rows(table)
        keep = [m for s in mine for m in s.metrics]
        frames.append(rows[rows["metric"].isin(keep)].assign(probe=probe.name, probe_task=task))
        if probe.name == "composition":
            links = partners(table, options.partners)
    rows = labelled(ranked(pd.concat([f for f in frames if len(f)], ignore_index=True)), rules())
    table = rows.assign(intervention="none", method="score", **run_info(cfg))
    table = results.conform(table.assign(task=table.pop("probe_task")))  # the task each score was read on
    texts = rule_texts(rules())
    classes = {label: heads_with(table, label) for label in texts}
    ctx.meta.update({"classes": classes, "rules": texts, "scores": wanted, "model_family": model.family})
    ctx.meta["options"] = dataclasses.asdict(options)
    if ctx.run_dir is not None:
        codes = {rule.label: rule.code for rule in rules()}
        html = page(table, {**cards, "partners": links, "rules": texts, "codes": codes, "model": model.name})
        Path(ctx.run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(ctx.run_dir) / PAGE, html.encode())
    return table


def heads_with(table: pd.DataFrame, label: str) -> list[str]:
    """The heads one of whose scores passes the rule of `label`, in layer and head order."""
    mine = table[table["label"].fillna("").astype(str).str.split(", ").apply(lambda labels: label in labels)]
    found = set(zip(mine["layer"].astype(int).tolist(), mine["head"].astype(int).tolist()))
    return [head_name(*h) for h in sorted(found)]


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """Per class, its heads; then the head table of the scores."""
    for label in rule_texts(rules()):
        heads = heads_with(df, label)
        console.print(f"[bold]{label}[/bold] ({len(heads)}): {' '.join(heads) or '-'}", highlight=False, soft_wrap=True)
    console.print(f"{len(df)} rows, {df['metric'].nunique()} scores", highlight=False)
    head_table(df, max_rows)


STUDY = Study(
    name="atlas",
    description="every head on one page: its scores from each study, labels by stated rules, atlas.html",
    run=run,
    summary=summary,
    reads=("train",),
    schema=AtlasOptions,
)
