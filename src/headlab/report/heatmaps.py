"""The report's head effects: per sweep, a layer x head heatmap per metric and panel, and the top heads.

A sweep here is one (experiment, model, task) and the values of the swept overrides that are not seeds
(collect adds each job's overrides as columns named like task.n_prompts): runs that differ only in seed
are averaged, as headlab.tables.effects does for the PNG figures, whose numbers these are. A cell
is coloured by its mean effect (RdBu, white at the clean value, limits symmetric and shared by a metric's
panels) and its title (the tooltip) holds the mean, the bootstrap interval over prompts, the range over
seeds and the number of seeds; its data-* attributes hold the same numbers unrounded.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
from matplotlib import colormaps, colors

from .. import tables

TOP_K = 5
CMAP = colormaps["RdBu"]
STYLE = """
.maps { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }
figure.heatmap { margin: 0; } figure.heatmap figcaption { font-size: 12px; color: #444; margin-bottom: 2px; }
table.heatmap td { min-width: 2.6em; height: 1.7em; text-align: center; border: 1px solid #fff; padding: 0 2px; }
table.heatmap th { background: none; border: none; font-weight: normal; color: #777; font-size: 11px; }
table.heatmap td.empty { background: #bfbfbf; } table.top td:nth-child(-n+3) { text-align: left; }
.legend { font-size: 11px; color: #555; width: 16em; }
.legend .bar { height: .9em; border: 1px solid #ccc; }
.legend .ticks { display: flex; justify-content: space-between; }
"""


def swept(table: pd.DataFrame) -> list[str]:
    """Override columns whose value differs between head rows of one (experiment, model, task) and panel."""
    rows = tables.head_rows(table)
    if rows.empty:
        return []
    keys = [rows[c] for c in tables.SECTION if c in rows] + [tables.panel_label(rows)]
    overrides = [c for c in rows.columns if "." in str(c)]
    varies = rows.groupby(keys, dropna=False)[overrides].nunique(dropna=False).gt(1).any()
    return [c for c in overrides if varies[c]]


def number(x: float) -> str:
    return f"{x:.4g}"


def interval(low: float, high: float) -> str:
    return f"[{number(low)}, {number(high)}]" if np.isfinite([low, high]).all() else ""


def tooltip(cell: pd.Series, metric: str) -> str:
    n = int(cell["n_seeds"])
    ci = interval(cell["ci_low"], cell["ci_high"])
    return "\n".join(
        (
            f"{tables.head_name(cell['layer'], cell['head'])} {metric}, {cell['panel']}",
            f"effect {number(cell['effect'])} (value {number(cell['value'])}, clean {number(cell['clean'])})",
            f"95% CI over prompts {ci}" if ci else "no interval over prompts",
            f"range over {n} seeds {interval(cell['seed_low'], cell['seed_high'])}" if n > 1 else "1 seed",
        )
    )


def cell_html(cell: pd.Series, metric: str, lim: float) -> str:
    effect = float(cell["effect"])
    background = colors.to_hex(CMAP(0.5 + effect / (2 * lim)))
    ink = "#fff" if abs(effect) > lim / 2 else "#222"  # RdBu's ends are dark
    data = " ".join(
        f"data-{k.replace('_', '-')}='{float(cell[k])!r}'"
        for k in ("effect", "ci_low", "ci_high", "seed_low", "seed_high")
        if np.isfinite(cell[k])
    )
    return (
        f"<td style='background:{background};color:{ink}' title='{html.escape(tooltip(cell, metric))}' {data} "
        f"data-seeds='{int(cell['n_seeds'])}'>{effect:.2g}</td>"
    )


def heatmap(title: str, cells: pd.DataFrame, metric: str, size: tuple[int, int], lim: float) -> str:
    at = {(int(c["layer"]), int(c["head"])): c for _, c in cells.iterrows()}
    header = "<tr><th></th>" + "".join(f"<th>H{h}</th>" for h in range(size[1])) + "</tr>"
    body = "".join(
        f"<tr><th>L{l}</th>"
        + "".join(
            cell_html(at[l, h], metric, lim) if (l, h) in at else "<td class='empty' title='no value'></td>"
            for h in range(size[1])
        )
        + "</tr>"
        for l in range(size[0])
    )
    caption = html.escape(title).replace("\n", "<br>")
    table = f"<table class='heatmap'>{header}{body}</table>"
    return f"<figure class='heatmap'><figcaption>{caption}</figcaption>{table}</figure>"


def legend(lim: float, clean: float) -> str:
    stops = ", ".join(colors.to_hex(CMAP(x)) for x in np.linspace(0, 1, 9))
    return (
        f"<div class='legend'><div class='bar' style='background:linear-gradient(to right, {stops})'></div>"
        f"<div class='ticks'><span>{number(-lim)}</span><span>clean ({number(clean)})</span>"
        f"<span>+{number(lim)}</span></div>"
        "<div>value - clean, mean over seeds; hover a cell for its interval</div></div>"
    )


def top_heads(cells: pd.DataFrame) -> str:
    rows = []
    for metric, of_metric in cells.groupby("metric", sort=False):
        moved = of_metric[of_metric["effect"] != 0]  # heads that change nothing are no one's top head
        for _, c in tables.strongest(moved, TOP_K).iterrows():
            seeds = interval(c["seed_low"], c["seed_high"]) if c["n_seeds"] > 1 else ""
            name, ci = tables.head_name(c["layer"], c["head"]), interval(c["ci_low"], c["ci_high"])
            cols = (metric, name, c["panel"], number(c["effect"]), ci, seeds, int(c["n_seeds"]))
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in cols) + "</tr>")
    header = "".join(
        f"<th>{h}</th>"
        for h in ("metric", "head", "panel", "effect", "95% CI over prompts", "range over seeds", "seeds")
    )
    return f"<h4>Top heads (largest |effect|)</h4><table class='top'><tr>{header}</tr>{''.join(rows)}</table>"


def section(table: pd.DataFrame) -> str:
    """The report's head-effect sections, one per sweep; empty when the table has no head rows."""
    cells = tables.effects(table, by=swept(table))
    if cells.empty:
        return ""
    keys = tables.section_columns(cells)
    parts = ["<h2>Head effects</h2>"]
    for key, of_sweep in cells.groupby(keys, dropna=False, sort=False):
        names = [str(v) if k in tables.SECTION else f"{k}={v}" for k, v in zip(keys, key)]
        seeds = int(of_sweep["n_seeds"].max())
        what = "one seed" if seeds == 1 else f"the mean over seeds (up to {seeds} per head)"
        parts.append(f"<h3>{html.escape(' / '.join(names))}</h3><p>Each head's effect, value - clean: {what}.</p>")
        size = tables.shape(of_sweep)
        for metric, of_metric in of_sweep.groupby("metric", sort=False):
            lim = float(of_metric["effect"].abs().max()) or 1.0
            maps = "".join(heatmap(t, c, str(metric), size, lim) for t, c in tables.panels(of_metric))
            legend_html = legend(lim, float(of_metric["clean"].mean()))
            parts.append(f"<h4>{html.escape(str(metric))}</h4><div class='maps'>{maps}{legend_html}</div>")
        parts.append(top_heads(of_sweep))
    return "\n".join(parts)
