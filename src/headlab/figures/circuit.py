"""Edge-level circuits (EAP / EAP-IG / exact edge patching): figures and numbers from the table alone.

  circuit_<method>.png  the circuit of each method, layered: input at the bottom, per layer its attention
                        heads side by side and its MLP a little above them, logits at the top; one line per
                        circuit edge, width by |score|, blue positive / red negative, line style by the
                        receiver's input (q solid, k dashed, v dotted, MLP dash-dot, logits solid)
  faithfulness.png      faithfulness vs share of edges kept (log x), one line per method and ranking, with
                        CPR / CMD in the legend where the summary rows exist
Nodes are read from the edge names alone: a receiver's node is its name less the <q>/<k>/<v> input, so a
grouped-query kv receiver `a{l}.kv{j}<k>` is drawn to a node of its own, `a{l}.kv{j}`, beside the layer's heads.
Several runs of one method (seeds) are averaged per edge; an edge is in the circuit if any run has it there.
A method scored on several metrics is drawn on the first (logit_diff first, else in sorted order).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from .canvas import ordered, save

MAX_DRAWN = 300
METHODS = ("eap", "eap_ig", "eap_ig_activations", "exact")
STYLE = {"q": "-", "k": "--", "v": ":", "mlp": "-.", "logits": "-"}  # line style by receiver input
BEND = {"k": 0.08, "v": -0.08}  # q, k and v edges from one sender into one head stay apart
SKIP_BEND = 0.4  # edges past a layer bend around the nodes in between (heads of a row stand in columns)
REACH = 2.0  # edges longer than this (in node spacings) bend less, so that their bulge stays below ~REACH * rad / 2
FILL = {"input": "#dddddd", "head": "#fff3c4", "mlp": "#d4efd4", "logits": "#dddddd"}
MLP_RISE = 0.4  # an MLP sits this far above its layer's heads


def _node(name: str) -> tuple[str, int, int]:
    """(kind, layer, order within its row) of a node name; input has layer -1, logits a layer of 10**6."""
    if m := re.fullmatch(r"a(\d+)\.(h|kv)(\d+)", name):
        return "head", int(m[1]), int(m[3]) + (10**4 if m[2] == "kv" else 0)
    if m := re.fullmatch(r"m(\d+)", name):
        return "mlp", int(m[1]), 10**5
    return ("input", -1, 0) if name == "input" else ("logits", 10**6, 0)


def _edges(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per edge: sender and receiver nodes, receiver input, mean score, in_circuit."""
    ends = rows["edge"].astype(str).str.split("->", n=1, expand=True)
    sender = rows["sender"].astype("string").fillna(ends[0]) if "sender" in rows else ends[0]
    receiver = rows["receiver"].astype("string").fillna(ends[1]) if "receiver" in rows else ends[1]
    df = pd.DataFrame(
        {
            "edge": rows["edge"].astype(str),
            "sender": sender.astype(str),
            "receiver": receiver.astype(str).str.split("<").str[0],
            "input": receiver.astype(str).str.extract(r"<(\w+)>$", expand=False),
            "value": pd.to_numeric(rows["value"], errors="coerce").astype(float),
            "in_circuit": rows["in_circuit"].astype("boolean").fillna(False).astype(bool),
        }
    )
    df["input"] = df["input"].fillna(df["receiver"].map(lambda r: "logits" if r == "logits" else "mlp"))
    agg = {"sender": "first", "receiver": "first", "input": "first", "value": "mean", "in_circuit": "any"}
    return df.groupby("edge", sort=False).agg(agg).reset_index()


def _draw_circuit(edges: pd.DataFrame, n_total: int, title: str, path: Path) -> None:
    nodes = sorted(set(edges["sender"]) | set(edges["receiver"]), key=_node)
    n_layers = 1 + max([_node(n)[1] for n in nodes if _node(n)[0] in ("head", "mlp")], default=-1)
    rows: dict[int, list[str]] = {}
    row = lambda n: min(_node(n)[1], n_layers)
    for n in nodes:  # one row per layer (input -1, logits n_layers), heads then kv nodes then the MLP
        rows.setdefault(row(n), []).append(n)
    pos: dict[str, tuple[float, float]] = {}
    for layer, names in rows.items():
        for i, n in enumerate(names):
            pos[n] = (i - (len(names) - 1) / 2, layer + 1 + (MLP_RISE if _node(n)[0] == "mlp" else 0.0))
    width = max(len(v) for v in rows.values())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * width + 2), max(4.0, 1.4 * (n_layers + 2))))
    mags = edges["value"].abs().to_numpy(float)
    scale = float(np.nanmax(mags)) if np.isfinite(mags).any() and np.nanmax(mags) > 0 else 1.0
    skip = lambda e: row(str(e.receiver)) - row(str(e.sender)) > 1
    span = lambda e: float(np.hypot(*np.subtract(pos[str(e.receiver)], pos[str(e.sender)])))
    bend = lambda e: (BEND.get(str(e.input), 0.0) + SKIP_BEND * skip(e)) * min(1.0, REACH / max(span(e), 1e-9))
    # every edge runs upward (senders are upstream of their receivers), so plain lines, weakest drawn first
    for e in edges.assign(mag=edges["value"].abs()).sort_values("mag").itertuples():
        patch = FancyArrowPatch(
            pos[str(e.sender)],
            pos[str(e.receiver)],
            arrowstyle="-",
            connectionstyle=f"arc3,rad={bend(e):.4f}",
            linewidth=0.5 + 5.5 * float(e.mag) / scale if np.isfinite(e.mag) else 0.5,
            linestyle=STYLE.get(str(e.input), "-"),
            color="0.6" if not np.isfinite(e.value) else "tab:blue" if float(e.value) >= 0 else "tab:red",
            alpha=0.65,
            zorder=1,
        )
        ax.add_patch(patch)
    for n, (x, y) in pos.items():
        box = dict(boxstyle="round,pad=0.25", facecolor=FILL[_node(n)[0]], edgecolor="0.4", linewidth=0.6)
        ax.text(x, y, n, ha="center", va="center", fontsize=7, bbox=box, zorder=3)
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(-0.5, n_layers + 1.5)
    ax.set_yticks(range(n_layers + 2), ["input", *(f"layer {l}" for l in range(n_layers)), "logits"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    capped = f" ({len(edges)} strongest drawn)" if len(edges) < n_total else ""
    ax.set_title(f"{title}{capped}", fontsize=9)
    handles = [Line2D([], [], color=c, lw=2, label=f"score {s} 0") for c, s in (("tab:blue", ">"), ("tab:red", "<"))]
    styles: dict[str, list[str]] = {}  # q and logits edges share the solid line
    for inp in ordered(edges["input"], ("q", "k", "v", "mlp", "logits")):
        styles.setdefault(STYLE.get(inp, "-"), []).append(inp)
    handles += [Line2D([], [], color="0.3", lw=1.5, ls=ls, label=f"into {' / '.join(v)}") for ls, v in styles.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    save(fig, path, dpi=120)


GRAPH = ("graph_edges", "graph_edges_ungrouped")  # the edges of the whole graph, counted both ways
# how far EAP-IG's scores moved from m to 2m steps (studies/circuit.py convergence), where a run measured it
CONVERGENCE = ("convergence_pearson", "convergence_max_change_over_max_score", "convergence_top_1pct_kept")


def _intervals(rows: pd.DataFrame, method: str, metrics: tuple[str, ...]) -> dict[str, list[float]]:
    """metric -> [ci_low, ci_high] of the method's rows that hold an interval (one run's; the first)."""
    out = {}
    for m in metrics:
        sel = rows[(rows["method"] == method) & (rows["metric"] == m)]
        if "ci_low" in sel:
            sel = sel.dropna(subset=["ci_low", "ci_high"])
            if len(sel):
                out[m] = [float(sel["ci_low"].iloc[0]), float(sel["ci_high"].iloc[0])]
    return out


def _summary(rows: pd.DataFrame, method: str, ranking: str) -> tuple[dict[str, float], str]:
    """Mean CPR / CMD / target numbers of a method (of its ranking where the rows name one), and its key."""
    sel, key = rows[rows["method"] == method], method
    if "ranking" in sel:  # rows of this ranking where there are, else those that name none
        named = sel["ranking"].astype("string")
        same = (named == ranking).fillna(False)
        sel, key = (sel[same], f"{method}_{ranking}") if same.any() else (sel[named.isna()], key)
    values = pd.to_numeric(sel["value"], errors="coerce")
    return {str(k): float(v) for k, v in values.groupby(sel["metric"]).mean().items() if np.isfinite(v)}, key


def _draw_faithfulness(curve: pd.DataFrame, summary: pd.DataFrame, path: Path, numbers: dict) -> None:
    curve = curve.assign(
        fraction=pd.to_numeric(curve["fraction"], errors="coerce"),
        value=pd.to_numeric(curve["value"], errors="coerce"),
        ranking=curve["ranking"].astype("string").fillna("signed") if "ranking" in curve else "signed",
    )
    curve = curve[(curve["fraction"] > 0) & np.isfinite(curve["value"].astype(float))]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, method in enumerate(ordered(curve["method"], METHODS)):
        for ranking in ordered(curve.loc[curve["method"] == method, "ranking"], ("signed", "absolute")):
            sel = curve[(curve["method"] == method) & (curve["ranking"] == ranking)]
            line = sel.groupby("fraction")["value"].mean().sort_index()
            label = f"{method} ({ranking})"
            s, key = _summary(summary, method, ranking)
            label += "".join(f", {m.upper()} {s[m]:.3g}" for m in ("cpr", "cmd") if m in s)
            if "target_edges" in s:
                label += f", {int(s['target_edges'])} edges to target"
            shown = ("cpr", "cmd", "target_edges", "target_edges_ungrouped", *GRAPH, *CONVERGENCE)
            numbers.update({f"{m}_{key}": s[m] for m in shown if m in s})
            numbers.update({f"{m}_ci_{key}": ci for m, ci in _intervals(summary, method, ("cpr", "cmd")).items()})
            ls, marker = ("-", "o") if ranking == "signed" else ("-.", "s")
            ax.plot(line.index, line.values, ls=ls, marker=marker, ms=3, color=f"C{k}", label=label)
    for y in (1.0, 0.8):
        ax.axhline(y, color="0.5", ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="fraction of edges kept", ylabel="faithfulness", title="Faithfulness of circuits")
    ax.legend(fontsize=7)
    save(fig, path, dpi=120)


def draw(table: pd.DataFrame, out: Path) -> dict:
    """circuit_<method>.png per method with circuit edges, faithfulness.png where curve rows exist."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    numbers: dict = {}
    if "intervention" not in table:
        return numbers
    df = table[table["prompt_id"].isna()] if "prompt_id" in table else table
    edge_rows = df[df["intervention"] == "edge"]
    if "in_circuit" in edge_rows and len(edge_rows):
        for method in ordered(edge_rows["method"], METHODS):
            rows = edge_rows[edge_rows["method"] == method]
            metric = next(iter(ordered(rows["metric"], ("logit_diff",))), "")
            rows = rows[(rows["metric"] == metric).fillna(False)] if metric else rows
            # the circuit's edges alone (all their rows): a million-edge graph's table parses in seconds
            kept = rows["in_circuit"].astype("boolean").fillna(False).astype(bool)
            if not kept.any():
                continue
            edges = _edges(rows[rows["edge"].isin(rows.loc[kept, "edge"].unique())])
            circuit = edges[edges["in_circuit"]]
            numbers[f"circuit_edges_{method}"] = len(circuit)
            shown = circuit.assign(mag=circuit["value"].abs().fillna(0)).nlargest(MAX_DRAWN, "mag")
            title = f"{method}: {len(circuit)} edges, {metric}"
            _draw_circuit(shown.drop(columns="mag"), len(circuit), title, out / f"circuit_{method}.png")
    circuit_rows = df[df["intervention"] == "circuit"]
    curve = circuit_rows[circuit_rows["metric"] == "faithfulness"]
    if "fraction" in curve and len(curve):
        _draw_faithfulness(
            curve, circuit_rows[circuit_rows["metric"] != "faithfulness"], out / "faithfulness.png", numbers
        )
    return numbers


FIGURE_SET = draw
