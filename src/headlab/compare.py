"""`headlab compare DIR`: one study run on several models, side by side, head class by head class.

DIR holds one complete run per model (a sweep over `model=`, or any dir `headlab collect` reads), all of
one study (meta.json's `study`). compare.parquet and compare.csv hold one row per model and class:

  n_heads, share  the class's heads and their share of the model's heads (those the model's table has
                  rows for: atlas and ioi_classes score every head); a head may be in several classes
  heads           "L5H1 L9H3", in layer and head order
  depth           the heads' mean relative depth, layer / (n_layers - 1): 0 the first layer, 1 the last
                  (empty for a one-layer model or an empty class)
  measured        False where the model's table does not score the class (an atlas run without that
                  score): n_heads, share and depth are then empty, not zero; a class no model's table
                  scores has no rows

The classes are the study's own: the atlas's labels (studies/atlas.py's heads_with reads the label its
rules gave, studies/atlas_rules.py), ioi_classes's `group` of its class rows (analysis/ioi_classes.py;
its "unclassed (<round>)" groups only where some model has such heads). Another study's per-head values
(head scores, method "score", and head effects as tables.effects gives them) are compared per measure:
its "class" is the top TOP_SHARE of each model's heads by |value|, and value_q10/median/q90 give the
distribution of the measure over all the model's heads. compare.png is drawn from the table alone
(figures/compare.py); meta.json, written last, names the runs.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from . import results
from .errors import HeadlabError
from .io import atomic_write_bytes
from .tables import effects, head_name, head_of

TABLE, CSV, META, FIGURE = "compare.parquet", "compare.csv", "meta.json", "compare.png"
TOP_SHARE = 0.05
CLASS_STUDIES = ("atlas", "ioi_classes")
MODEL_KEYS = ("model", "model.name", "model.path")  # the overrides that choose another model
MAX_MESSAGE = 190  # the CLI prefixes "error: ": the line stays under 200 characters
Members = dict[str, list[tuple[int, int]] | None]  # class -> heads; None: not scored in this model's table
QUANTILES = (("q10", 0.1), ("median", 0.5), ("q90", 0.9))
COLUMNS = [
    "model", "class", "n_heads", "share", "heads", "depth", "measured", "n_layers", "n_model_heads",
    "value_q10", "value_median", "value_q90", "study", "kind", "run_dir",
]  # fmt: skip
DTYPES = {"model": "string", "class": "string", "n_heads": "Int64", "heads": "string", "measured": "boolean"}


def refuse(message: str) -> HeadlabError:
    return HeadlabError(message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "...")


def load(directory: Path) -> tuple[pd.DataFrame, str]:
    """Every complete run's table below `directory` and their study; refused unless it is one study, one
    run per model, two or more models."""
    table = results.collect(directory)
    studies = {}
    for run_dir in table["run_dir"].unique():
        meta = json.loads((Path(directory) / str(run_dir) / results.META).read_text())
        studies[str(run_dir)] = str(meta.get("study") or "unknown")
    if len(set(studies.values())) > 1:
        named = ", ".join(sorted(set(studies.values())))
        raise refuse(f"compare: the runs below {directory} are of different studies ({named}); give it one study's")
    runs = table.groupby("model", sort=False)["run_dir"].unique()
    if len(runs) < 2:
        raise refuse(f"compare: every run below {directory} is of model {runs.index[0]}; it needs two models or more")
    several = runs[runs.map(len) > 1]
    if len(several):
        model, dirs = several.index[0], several.iloc[0]
        raise refuse(
            f"compare: {len(dirs)} runs of model {model} ({', '.join(map(str, dirs))}); it needs one per model"
        )
    return table, next(iter(studies.values()))


def atlas_members(rows: pd.DataFrame) -> Members:
    from .studies.atlas import heads_with
    from .studies.atlas_probes import rules

    if "label" not in rows:
        raise refuse("compare: an atlas table without its label column (written before the atlas's rules)")
    scored = set(rows["metric"])
    return {
        rule.label: [head_of(name) for name in heads_with(rows, rule.label)] if rule.metric in scored else None
        for rule in rules()
    }


def ioi_members(rows: pd.DataFrame) -> Members:
    from .analysis.ioi_classes import CLASS_METHOD, CLASSES, UNCLASSED

    found: Members = {cls: [] for cls in (*CLASSES, *UNCLASSED.values())}
    mine = rows[(rows["method"] == CLASS_METHOD) & (rows["metric"] == "path_effect")]
    for cls, part in mine.groupby("group", sort=False):
        found[str(cls)] = sorted(set(zip(part["layer"].astype(int), part["head"].astype(int))))
    return found


def measures(table: pd.DataFrame) -> pd.DataFrame:
    """Per-head values of any study: model, measure, layer, head, value (effects where there is a clean
    run to subtract, else values; head scores as they are; each the mean over seeds)."""
    cells = effects(table)
    cells = cells.assign(value=cells["effect"].fillna(cells["value"]), measure=cells["panel"] + ": " + cells["metric"])
    scores = table[(table["intervention"] == "none") & (table["method"] == "score")].dropna(subset=["layer", "head"])
    if "prompt_id" in scores:
        scores = scores[scores["prompt_id"].isna()]
    scores = scores.groupby(["model", "metric", "layer", "head"], sort=False)["value"].mean().reset_index()
    scores = scores.assign(measure="score: " + scores["metric"])
    keep = ["model", "measure", "layer", "head", "value"]
    both = pd.concat([cells[keep], scores[keep]], ignore_index=True).dropna(subset=["value"])
    return both.astype({"layer": int, "head": int, "model": str, "measure": str})


def class_row(found: list[tuple[int, int]] | None, n_layers: int) -> dict[str, Any]:
    if found is None:
        return {"n_heads": pd.NA, "heads": "", "depth": math.nan, "measured": False}
    depths = [layer / (n_layers - 1) for layer, _ in found] if n_layers > 1 else []
    return {
        "n_heads": len(found),
        "heads": " ".join(head_name(*h) for h in found),
        "depth": sum(depths) / len(depths) if depths else math.nan,
        "measured": True,
    }


def members(rows: pd.DataFrame, study: str, values: pd.DataFrame) -> tuple[Members, dict[str, pd.Series]]:
    """One model's classes and their heads; for a study without classes, per measure of `values` (this
    model's measures rows) its top heads by |value| and its values over all heads."""
    if study == "atlas":
        return atlas_members(rows), {}
    if study == "ioi_classes":
        return ioi_members(rows), {}
    k = max(1, round(TOP_SHARE * len(rows.dropna(subset=["layer", "head"])[["layer", "head"]].drop_duplicates())))
    found: Members = {}
    spread: dict[str, pd.Series] = {}
    for measure, part in values.groupby("measure", sort=False):
        name = f"top {TOP_SHARE:.0%} |{measure}|"
        top = part.loc[part["value"].abs().sort_values(ascending=False, kind="stable").index[:k]]
        found[name] = sorted(zip(top["layer"], top["head"]))
        spread[name] = part["value"]
    return found, spread


def compare_table(table: pd.DataFrame, study: str) -> pd.DataFrame:
    """One row per model and class (module docstring), models and classes in the order of the runs."""
    values = measures(table) if study not in CLASS_STUDIES else pd.DataFrame(columns=["model", "measure"])
    per_model = {}
    for model, rows in table.groupby("model", sort=False):
        heads = rows.dropna(subset=["layer", "head"])[["layer", "head"]].drop_duplicates()
        if heads.empty:
            raise refuse(f"compare: the {study} table of {model} has no per-head rows")
        shape = {"n_layers": int(heads["layer"].max()) + 1, "n_model_heads": len(heads)}
        shape["run_dir"] = rows["run_dir"].iloc[0]
        per_model[str(model)] = (shape, *members(rows, study, values[values["model"] == model]))
    if not any(found for _, found, _ in per_model.values()):
        supported = ", ".join(CLASS_STUDIES)
        raise refuse(
            f"compare: the {study} runs hold no per-head values; it compares {supported}, head scores or effects"
        )
    classes = list(dict.fromkeys(cls for _, found, _ in per_model.values() for cls in found))
    records = []
    for model, (shape, found, spread) in per_model.items():
        for cls in classes:
            row = class_row(found.get(cls), shape["n_layers"])
            share = row["n_heads"] / shape["n_model_heads"] if row["measured"] else math.nan
            got = spread.get(cls)
            quantiles = {f"value_{q}": math.nan if got is None else got.quantile(p) for q, p in QUANTILES}
            records.append({"model": model, "class": cls, **row, "share": share, **shape, **quantiles})
    out = pd.DataFrame(records)
    out = out[out.groupby("class", sort=False)["measured"].transform("any")]  # a score no run took: no class
    if out.empty:
        raise refuse(f"compare: the {study} runs score no class (atlas: run it with a class's score)")
    if study == "ioi_classes":  # an unclassed group that no model has is no class of either
        empty = out.groupby("class", sort=False)["n_heads"].transform("sum") == 0
        out = out[~(empty & out["class"].str.startswith("unclassed"))]
    out = out.assign(study=study, kind="class" if study in CLASS_STUDIES else "top heads")
    return out[COLUMNS].astype(DTYPES).reset_index(drop=True)


def write(directory: Path, out: Path | None = None) -> tuple[Path, pd.DataFrame]:
    """compare.parquet, compare.csv, compare.png, then meta.json into `out` (default DIR/compare); on a
    refusal nothing is written. Returns the output dir and the table."""
    from .figures.compare import png

    directory = Path(directory)
    table, study = load(directory)
    compared = compare_table(table, study)
    picture = png(compared)
    target = Path(out) if out is not None else directory / "compare"
    target.mkdir(parents=True, exist_ok=True)
    (target / META).unlink(missing_ok=True)  # an old marker must not vouch for new files
    buffer = io.BytesIO()
    compared.to_parquet(buffer, index=False)
    atomic_write_bytes(target / TABLE, buffer.getvalue())
    atomic_write_bytes(target / CSV, compared.to_csv(index=False).encode())
    atomic_write_bytes(target / FIGURE, picture)
    models = compared.drop_duplicates("model").set_index("model")
    extra = {
        "source": str(directory.resolve()),
        "study": study,
        "classes": compared["class"].drop_duplicates().tolist(),
        "models": {m: {k: r[k] for k in ("run_dir", "n_layers", "n_model_heads")} for m, r in models.iterrows()},
        "top_share": TOP_SHARE if study not in CLASS_STUDIES else None,
    }
    atomic_write_bytes(target / META, json.dumps(results.run_meta("", {}, extra), indent=2, default=str).encode())
    return target, compared


def side_by_side(compared: pd.DataFrame) -> pd.DataFrame:
    """class x model cells "n (share%) depth d", for the terminal."""
    cell = compared.apply(
        lambda r: (
            "not scored"
            if not r["measured"]
            else f"{r['n_heads']} ({r['share']:.0%})" + ("" if pd.isna(r["depth"]) else f" depth {r['depth']:.2f}")
        ),
        axis=1,
    )
    wide = compared.assign(cell=cell).pivot(index="class", columns="model", values="cell")
    return wide.reindex(index=compared["class"].unique(), columns=compared["model"].unique())


def swept_models(jobs: dict[str, list[dict]]) -> list[str]:
    """The models a sweep's finished jobs ran (multirun.summarize's jobs), each as its overrides of
    MODEL_KEYS name it ("model=hf model.path=DIR": "hf DIR"), in job order."""
    values = []
    for job in [*jobs.get("done", []), *jobs.get("skipped", [])]:
        given = dict(str(item).lstrip("+~").partition("=")[::2] for item in job.get("overrides") or [])
        values.append(" ".join(given[key] for key in MODEL_KEYS if key in given))
    return [v for v in dict.fromkeys(values) if v]
