"""atlas.html: every head of a model on one self-contained page (studies/atlas.py writes it).

The layer x head grid, coloured by the score the menu picks, as wide as the page (layers across where a model
has more layers than heads); a head's labels on its cell as short codes (extras' `codes`: each rule's own; the
legend beside the grid says each one and how many heads have it; a class most heads share is a mark in the
cell's corner, not a word, so the rarer ones stay legible; the rule on hover); a click opens the head's card
(atlas.js, beside this file): every score with its interval and rank, its labels and why, its composition
partners (clickable), its attention pattern on the example prompt, why it attends where it does on its typical
edge there (which components build the query and which the key, exact at the clean run's norm scales:
studies/head_attribution.py; held beside free removal where the norms move), what its output there writes and
which components wrote it, MAPS's weights-only mappings over the text's tokens, and the tokens it attends to
and writes most on the text. Below, every head in a table to search and sort. Styles, script and data are
inlined: the file opens with no network, like report.html.
"""

from __future__ import annotations

import html
import json
import math
from importlib.resources import files
from typing import Any

import pandas as pd

from ..tables import head_name
from .page import ON_ERROR
from .page import STYLE as REPORT_STYLE

STYLE = """
body { max-width: 1500px; }
#atlas-controls { display: flex; gap: 1em; align-items: center; flex-wrap: wrap; margin: .5em 0; }
#atlas-grid { width: 100%; table-layout: fixed; border-collapse: collapse; }
#atlas-grid td { height: 2.2em; cursor: pointer; font-size: 10px; line-height: 1.1; text-align: center;
  padding: 0 1px; border: 1px solid #fff; position: relative; overflow: hidden; }
#atlas-grid td.picked { outline: 3px solid #000; } #atlas-grid td.dim { opacity: .25; }
#atlas-grid th { font-weight: normal; font-size: 11px; }
#atlas-grid th.corner { width: 2.5em; }
#atlas-grid td .code { background: rgba(255,255,255,.85); border-radius: 2px; padding: 0 1px; }
#atlas-grid td .mark { position: absolute; top: 1px; right: 2px; font-size: 9px; color: #000;
  text-shadow: 0 0 2px #fff; }
#atlas-codes { font-size: 12px; margin: .3em 0; display: flex; flex-wrap: wrap; gap: .2em 1.2em; }
#atlas-codes span { white-space: nowrap; }
#atlas-codes b { background: #eee; padding: 0 2px; }
#atlas-layout { display: flex; flex-direction: column; gap: 1em; }
#atlas-card { border: 1px solid #ccc; padding: .5em 1em; columns: 2 480px; column-gap: 2em; }
#atlas-card > * { break-inside: avoid; } #atlas-card h3 { column-span: all; } #atlas-card h4 { break-after: avoid; }
#atlas-card[hidden] { display: none; } #atlas-card a { cursor: pointer; color: #0645ad; }
#atlas-card td.text, #atlas-heads td.text { text-align: left; }
#atlas-heads th { cursor: pointer; white-space: nowrap; }
#atlas-legend { font-size: 12px; color: #555; }
"""


COMMON = 0.5  # a label more than this share of the heads have is a mark on its cells, not a code


def _number(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) or math.isinf(v) else round(v, 5)


def atlas_data(table: pd.DataFrame, extras: dict) -> dict:
    """The page's data: heads, and per score and head [value, ci_low, ci_high, rank, n, partner]."""
    n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
    scores: dict[str, dict[str, list]] = {}
    labels: dict[str, list[list[str]]] = {}
    blank = pd.Series([None] * len(table), index=table.index, dtype=object)
    columns = [
        table["layer"].astype(int).tolist(),
        table["head"].astype(int).tolist(),
        table["metric"].astype(str).tolist(),
        *(table[c].tolist() for c in ("value", "ci_low", "ci_high")),
        *(
            table[c].astype(object).where(table[c].notna(), None).tolist() if c in table else blank.tolist()
            for c in ("rank", "n", "partner", "label", "rule")
        ),
    ]
    for layer, head, metric, value, low, high, rank, n, partner, label, rule in zip(*columns):
        name = head_name(layer, head)
        scores.setdefault(metric, {})[name] = [
            _number(value),
            _number(low),
            _number(high),
            None if rank is None else int(rank),
            None if n is None else int(n),
            None if partner is None else str(partner),
        ]
        if label:
            for one, why in zip(str(label).split(", "), str(rule).split("; ")):
                labels.setdefault(name, []).append([one, why])
    signed = [m for m in scores if any((v[0] or 0) < 0 for v in scores[m].values())]
    return {
        "n_layers": n_layers,
        "n_heads": n_heads,
        "scores": scores,
        "signed": signed,
        "labels": labels,
        "common": COMMON,
        **extras,
    }


def page(table: pd.DataFrame, extras: dict) -> str:
    data = atlas_data(table, extras)
    blob = json.dumps(data, allow_nan=False).replace("<", "\\u003c")  # can never close the script element
    script = files(__package__).joinpath("atlas.js").read_text()
    model = html.escape(str(extras.get("model", "")))
    rules = "".join(
        f"<li><b>{html.escape(label)}</b>: {html.escape(rule)}</li>" for label, rule in extras.get("rules", {}).items()
    )
    body = (
        f"<h1>headlab atlas: {model}</h1>"
        f"<p>{data['n_layers']} layers x {data['n_heads']} heads, {len(data['scores'])} scores. Click a head for "
        "its card; hover a label for the rule it passed.</p>"
        "<div id='atlas-controls'><label>colour by <select id='atlas-score'></select></label>"
        "<label>head <input id='atlas-search' type='search' placeholder='e.g. L3H2 or L3 or induction'></label>"
        "<span id='atlas-legend'></span></div>"
        "<div id='atlas-codes'></div>"
        "<div id='atlas-layout'><table id='atlas-grid'></table><div id='atlas-card' hidden></div></div>"
        "<h2>Every head</h2><p>Click a column to sort by it (again to reverse); the search above filters.</p>"
        "<div class='scroll'><table id='atlas-heads'><thead></thead><tbody></tbody></table></div>"
        f"<h2>Class rules</h2><ul>{rules}</ul>"
        "<noscript>The atlas needs JavaScript; its rows are in results.csv.</noscript>"
        f"<script type='application/json' id='atlas-data'>{blob}</script><script>{script}</script>"
    )
    head = f"<meta charset='utf-8'><title>headlab atlas: {model}</title><style>{REPORT_STYLE}{STYLE}</style>"
    return f"<!doctype html><html><head>{head}{ON_ERROR}</head><body>{body}</body></html>"
