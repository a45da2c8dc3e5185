"""`headlab report DIR`: one self-contained report.html for a run, a sweep or a reproduction.

Everything is inlined (styles, tables, figures as base64 PNG), so the file can be mailed or archived.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import pandas as pd

from . import results
from .errors import HeadlabError
from .io import atomic_write_bytes
from .sweeps import STATUS

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; margin-top: 2em; }
table { border-collapse: collapse; font-size: 12px; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
th { background: #f4f4f4; } pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; } .failed { color: #b00; }
"""


def _runs(directory: Path) -> list[Path]:
    return sorted(p.parent for p in directory.rglob(results.META) if results.is_complete(p.parent))


def _table(df: pd.DataFrame, max_rows: int = 400) -> str:
    shown = df.head(max_rows)
    note = f"<p>{len(df) - max_rows} more rows in the parquet file.</p>" if len(df) > max_rows else ""
    return shown.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}", border=0) + note


def build(directory: Path) -> str:
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadlabError(f"no such directory: {directory}")
    runs = _runs(directory)
    if not runs:
        raise HeadlabError(f"no complete runs (results.parquet with meta.json) below {directory}")
    table = results.collect(directory)
    parts = [
        f"<h1>headlab report: {html.escape(directory.name)}</h1>",
        f"<p>{len(runs)} run(s) below <code>{html.escape(str(directory))}</code>, {len(table)} rows.</p>",
    ]

    statuses = [(p.parent, json.loads(p.read_text())) for p in sorted(directory.rglob(STATUS))]
    if statuses:
        rows = "".join(
            f"<tr><td>{html.escape(str(d.relative_to(directory)))}</td>"
            f"<td class='{s['status']}'>{s['status']}</td><td>{html.escape(s.get('error') or '')}</td></tr>"
            for d, s in statuses
        )
        parts.append(f"<h2>Jobs</h2><table><tr><th>job</th><th>status</th><th>error</th></tr>{rows}</table>")

    figures = sorted(directory.rglob("*.png"))
    if figures:
        parts.append("<h2>Figures</h2>")
        for fig in figures:
            data = base64.b64encode(fig.read_bytes()).decode()
            parts.append(
                f"<h3>{html.escape(fig.name)}</h3>"
                f"<img alt='{html.escape(fig.name)}' src='data:image/png;base64,{data}'>"
            )

    aggregated = table[table["n"] > 1] if "prompt_id" in table else table
    parts.append("<h2>Results</h2>" + _table(aggregated))

    timing_rows = []
    for run in runs:
        meta = json.loads((run / results.META).read_text())
        timing_rows.append(
            {
                "run": str(run.relative_to(directory)) or ".",
                **meta.get("seconds", {}),
                "config_hash": meta.get("config_hash"),
                "git_commit": (meta.get("git_commit") or "")[:10],
            }
        )
    parts.append("<h2>Timings (seconds)</h2>" + _table(pd.DataFrame(timing_rows)))

    configs = [(run, run / ".hydra" / "config.yaml") for run in runs]
    configs = [(run, path) for run, path in configs if path.is_file()]
    if configs:
        parts.append("<h2>Configuration</h2>")
        first_run, first = configs[0]
        parts.append(
            f"<p>{html.escape(str(first_run.relative_to(directory)) or '.')}</p>"
            f"<pre>{html.escape(first.read_text())}</pre>"
        )
        for run, _ in configs[1:]:
            overrides = run / ".hydra" / "overrides.yaml"
            text = overrides.read_text() if overrides.is_file() else ""
            parts.append(
                f"<p>{html.escape(str(run.relative_to(directory)))} overrides:</p><pre>{html.escape(text)}</pre>"
            )
    body = "\n".join(parts)
    head = f"<meta charset='utf-8'><title>headlab report</title><style>{STYLE}</style>"
    return f"<!doctype html><html><head>{head}</head><body>{body}</body></html>"


def write(directory: Path) -> Path:
    target = Path(directory) / "report.html"
    atomic_write_bytes(target, build(directory).encode())
    return target
