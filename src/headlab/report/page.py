"""`headlab report DIR`: one self-contained report.html for a run, a sweep or a reproduction.

Everything is inlined (styles, script, figures as base64 PNG), so the file can be mailed or archived and
opens with no network. In reading order: the head effects per sweep (heatmaps.py), the figures, the jobs'
status, the result table (table.py), then timings and configs.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import pandas as pd

from .. import results
from ..errors import HeadlabError
from ..io import atomic_write_bytes
from ..multirun import STATUS, summarize
from . import heatmaps, table

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; margin-top: 2em; }
h3 { font-size: 1.05em; margin-top: 1.5em; } h4 { margin: 1em 0 .3em; }
table { border-collapse: collapse; font-size: 12px; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
th { background: #f4f4f4; } pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: 12px; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; } .figures figure { margin: 0; max-width: 48%; }
.figures img { max-width: 100%; border: 1px solid #eee; } figcaption { font-size: 12px; color: #555; }
summary { cursor: pointer; margin: .6em 0; font-weight: 600; } .failed { color: #b00; }
.script-error { color: #fff; background: #b00; padding: .5em; }
"""
OPEN_FIGURES = 12  # up to this many figures show unfolded; a longer list folds into one line per folder
# before any other script: an error in the page's script shows on the page (and to a headless test)
ON_ERROR = """<script>
window.addEventListener("error", function (e) {
  document.documentElement.setAttribute("data-script-error", String(e.message));
  var p = document.createElement("p"); p.className = "script-error"; p.textContent = "script error: " + e.message;
  (document.body || document.documentElement).prepend(p);
});
</script>"""


def relative(path: Path, directory: Path) -> str:
    path, directory = path.resolve(), directory.resolve()
    return str(path.relative_to(directory)) if path.is_relative_to(directory) else str(path)


def plain_table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}", border=0)


def jobs(directory: Path) -> list[dict]:
    """status.json of every job below directory; a sweep's job dir without one counts as failed."""
    found = sorted(directory.rglob(STATUS))
    out = [dict(json.loads(p.read_text()), dir=str(p.parent)) for p in found if p.parent == directory]
    for sweep in sorted({p.parent.parent for p in found if p.parent != directory}):
        out += sorted((s for group in summarize(sweep).values() for s in group), key=lambda s: s["dir"])
    return out


def jobs_section(directory: Path) -> str:
    statuses = jobs(directory)
    if not statuses:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(relative(Path(s['dir']), directory))}</td><td class='{html.escape(s['status'])}'>"
        f"{html.escape(s['status'])}</td><td>{html.escape(s.get('error') or '')}</td>"
        f"<td>{html.escape(relative(Path(s['log']), directory) if s.get('log') else '')}</td>"
        f"<td>{html.escape(' '.join(s.get('overrides') or []))}</td></tr>"
        for s in statuses
    )
    counts = pd.Series([s["status"] for s in statuses]).value_counts()
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    header = "".join(f"<th>{h}</th>" for h in ("job", "status", "error", "log", "overrides"))
    return f"<h2>Jobs</h2><p>{summary}</p><table><tr>{header}</tr>{rows}</table>"


def figures_section(directory: Path) -> str:
    figures = sorted(directory.rglob("*.png"))
    if not figures:
        return ""
    parts = ["<h2>Figures</h2>"]
    shown = " open" if len(figures) <= OPEN_FIGURES else ""
    for folder in sorted({f.parent for f in figures}):
        count = sum(f.parent == folder for f in figures)
        summary = f"<summary>{html.escape(relative(folder, directory))} ({count})</summary>"
        parts.append(f"<details{shown}>{summary}<div class='figures'>")
        for fig in (f for f in figures if f.parent == folder):
            data = base64.b64encode(fig.read_bytes()).decode()
            name = html.escape(fig.name)
            parts.append(
                f"<figure><img alt='{name}' src='data:image/png;base64,{data}'><figcaption>{name}</figcaption></figure>"
            )
        parts.append("</div></details>")
    return "".join(parts)


def timings_section(runs: list[Path], directory: Path) -> str:
    timing_rows = []
    for run in runs:
        meta = json.loads((run / results.META).read_text())
        timing_rows.append(
            {
                "run": relative(run, directory) or ".",
                **meta.get("seconds", {}),
                "config_hash": meta.get("config_hash"),
                "git_commit": (meta.get("git_commit") or "")[:10],
            }
        )
    return "<h2>Timings (seconds)</h2>" + plain_table(pd.DataFrame(timing_rows))


def configs_section(runs: list[Path], directory: Path) -> str:
    configs = [(run, run / ".hydra" / "config.yaml") for run in runs]
    configs = [(run, path) for run, path in configs if path.is_file()]
    if not configs:
        return ""
    first_run, first = configs[0]
    parts = [
        "<h2>Configuration</h2>",
        f"<p>{html.escape(relative(first_run, directory) or '.')}</p><pre>{html.escape(first.read_text())}</pre>",
    ]
    for run, _ in configs[1:]:
        overrides = run / ".hydra" / "overrides.yaml"
        text = overrides.read_text() if overrides.is_file() else ""
        parts.append(f"<p>{html.escape(relative(run, directory))} overrides:</p><pre>{html.escape(text)}</pre>")
    return "".join(parts)


def build(directory: Path) -> str:
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadlabError(f"no such directory: {directory}")
    runs = sorted(p.parent for p in directory.rglob(results.META) if results.is_complete(p.parent))
    if not runs:
        raise HeadlabError(f"no complete runs (results.parquet with meta.json) below {directory}")
    collected = results.collect(directory)
    parts = [
        f"<h1>headlab report: {html.escape(directory.name)}</h1>",
        f"<p>{len(runs)} run(s) below <code>{html.escape(str(directory))}</code>, {len(collected)} rows.</p>",
        heatmaps.section(collected),
        figures_section(directory),
        jobs_section(directory),
        table.section(collected),
        timings_section(runs, directory),
        configs_section(runs, directory),
    ]
    style = STYLE + heatmaps.STYLE + table.STYLE
    head = f"<meta charset='utf-8'><title>headlab report: {html.escape(directory.name)}</title><style>{style}</style>"
    return f"<!doctype html><html><head>{head}{ON_ERROR}</head><body>{''.join(parts)}</body></html>"


def write(directory: Path) -> Path:
    target = Path(directory) / "report.html"
    atomic_write_bytes(target, build(directory).encode())
    return target
