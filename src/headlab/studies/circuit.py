"""study=circuit (or circuit=<method>): circuit discovery on the task's clean and counterfactual prompts (edges/).

Scores every edge (or node) of the model's graph, then, for edges, the faithfulness curve, CPR, CMD and
the smallest circuit reaching study.target; writes <run>/circuit.json (EAP-IG's graph layout, the
reported circuit marked in_graph) beside the table, and the circuit's figure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np
import pandas as pd
import torch
from rich.table import Table
from torch import Tensor

from .. import results
from ..config import option, run_info
from ..config_rules import COUNT, NATURAL, SHARE, Each, Known, OneOf, Range, setting
from ..edges.eap import doubled_steps
from ..edges.exact import exact_scores
from ..edges.faithfulness import Faithfulness, measure
from ..edges.graph import KV_EDGES, EdgeGraph, Receiver, Sender, write_json
from ..edges.methods import Budget, method_names
from ..edges.methods import get as get_method
from ..edges.postnorm import POST_NORM_RULES
from ..edges.record import metric_column
from ..vocabulary import Site, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import aggregated, console

CIRCUIT_FILE = "circuit.json"
MIN_GAP = 0.01  # a clean-corrupted gap in the metric below which faithfulness is noise


class CircuitLevel(str, Enum):
    edges = "edges"
    nodes = "nodes"


class CircuitSelection(str, Enum):
    top_n = "top_n"  # the n edges of highest score, pruned of dangling edges
    greedy = "greedy"  # grown from the logits up (EAP-IG's apply_greedy)


@dataclass
class CircuitOptions(StudyOptions):
    """`study=circuit` (`circuit=<method>`): circuits on edges (or nodes) from the task's counterfactual prompts."""

    name: str = "circuit"

    # a record of edges/methods.py (eap, eap_ig, eap_ig_activations, exact, or one registered there); eap_ig
    # is MIB's best-ranked edge method (2504.13151)
    method: str = setting("eap_ig", Known(method_names))
    level: CircuitLevel = CircuitLevel.edges
    steps: int = setting(5, COUNT)  # eap_ig*: interpolation steps (Hanna et al. use 5)
    # eap_ig*: the sum runs over alpha = k/steps for k = ig_steps_from .. ig_steps_from + steps - 1; None: as
    # hannamw/EAP-IG's code (MIB's) sums each method, eap_ig from 0 (the corrupted endpoint in, the clean one
    # out), eap_ig_activations from 1 (edges/eap.py AUTHORS_STEPS_FROM); 1 is the EAP-IG paper's k = 1..steps
    ig_steps_from: int | None = setting(None, Range(0, 1, integer=True))
    selection: CircuitSelection = CircuitSelection.top_n
    faithfulness: bool = True  # the faithfulness curve, CPR, CMD and the smallest circuit reaching target
    target: float = setting(0.8, SHARE)  # share of the clean-corrupted gap the reported circuit recovers
    fractions: list[float] = setting(
        factory=lambda: [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0],
        rule=Each(Range(0, 1, low_open=True)),
    )
    # grouped-query models' key and value edges (edges/graph.py): ungrouped, each query head's key and value
    # inputs scored, ranked and patched apart, as MIB's graph has them; grouped, one per key/value head
    kv_edges: str = setting("ungrouped", OneOf(KV_EDGES))
    # circuit sizes (the fractions, the target circuit) count edges as MIB and auto-circuit do, one per
    # query head under GQA (ungrouped), or as this graph holds them (grouped: one per key/value head under
    # kv_edges=grouped; the same count under kv_edges=ungrouped)
    edge_count: str = setting("ungrouped", OneOf(("ungrouped", "grouped")))
    # eap_ig*: also score at twice the steps and report how far the scores moved (meta.json convergence)
    convergence: bool = False
    # a model that norms each component's output (Gemma 2 and 3): what a head's edge carries; mib: its
    # output before the norm, the norm run again on each receiver's mixture (hannamw/EAP-IG's code, MIB's
    # numbers); shares: its share of the normed output, so that EAP is exact patching's first-order term
    # (edges/postnorm.py)
    post_norm: str = setting("mib", OneOf(POST_NORM_RULES))
    # also patch this many edges exactly (the top half by |score|, the rest at random)
    exact_check: int = setting(0, NATURAL)
    # prompts per gradient pass: bounds the memory of the activation differences
    prompts_per_pass: int = setting(16, COUNT)
    # the prompts whose recordings the faithfulness curve holds at once (None: all of them, recorded once);
    # fewer are recorded again for each circuit of the bisection (edges/faithfulness.Evaluator). Where all do
    # not fit, engine.max_memory sets it
    curve_prompts: int | None = setting(None, COUNT)


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, c = ctx.cfg, ctx.options
    metric_column(ctx.get_task())  # a task without a smooth metric is refused before any model is trained
    model, task, data = ctx.get_model(), ctx.get_task(), ctx.get_data()
    graph = EdgeGraph.of(model, c.post_norm, c.kv_edges)
    method, info = option(c.method), run_info(cfg)
    info.update(metric=task.smooth_quantity, n=data.n)
    n_ungrouped = graph.total(ungrouped=True)
    ctx.meta.update(
        n_prompts=data.n,
        n_edges=graph.n_edges,
        n_edges_ungrouped=n_ungrouped,
        kv_edges="grouped" if graph.grouped else "ungrouped",
        n_nodes=len(graph.senders),
        model_family=model.family,
    )
    record = get_method(method)
    budget = Budget(c.steps, c.prompts_per_pass, c.ig_steps_from, cfg.engine.chunk_mb, ctx.show_progress)
    if option(c.level) == "nodes":
        with ctx.timed(method):
            node_scores = record.nodes(model, task, data, graph, replace(budget, show_progress=False))
        return results.conform(node_rows(graph, node_scores, method, info))
    with ctx.timed(method):
        scores = record.edges(model, task, data, graph, budget)
    base = circuit_row(info, method)
    sizes = (("graph_edges", graph.n_edges), ("graph_edges_ungrouped", n_ungrouped))
    tables = [
        edge_rows(graph, scores, method, info),
        pd.DataFrame([{**base, "metric": m, "value": v} for m, v in sizes]),
    ]
    if c.convergence and record.integrates:
        with ctx.timed(f"{method}_twice_the_steps"):
            model, task, data = ctx.get_model(), ctx.get_task(), ctx.get_data()
            twice = doubled_steps(
                model,
                task,
                data,
                graph,
                method,
                scores,
                c.steps,
                c.prompts_per_pass,
                ctx.show_progress,
                c.ig_steps_from,
            )
            moved = ctx.meta["convergence"] = convergence(scores, twice, graph, c.steps)
        tables.append(
            pd.DataFrame([{**base, "metric": f"convergence_{k}", "value": v} for k, v in moved.items() if k != "steps"])
        )
    circuit = torch.zeros_like(graph.real)
    if c.exact_check and record.name != "exact":
        with ctx.timed("exact_check"):
            tables.append(exact_check(ctx, graph, scores, info))
    if c.faithfulness:
        with ctx.timed("faithfulness"):
            f = measure(
                model,
                task,
                data,
                graph,
                scores,
                tuple(c.fractions),
                c.target,
                option(c.selection),
                ctx.show_progress,
                ungrouped=c.edge_count == "ungrouped",
                n_boot=cfg.output.n_boot,
                seed=cfg.seed,
                held=c.curve_prompts,
            )
        circuit = f.target_circuit
        if abs(f.clean - f.corrupted) < MIN_GAP:
            ctx.note(
                f"the clean and corrupted runs differ by {abs(f.clean - f.corrupted):.2g} in {task.smooth_quantity}: "
                "faithfulness (a share of that gap) means little here"
            )
        tables.append(faithfulness_rows(f, method, info))
        ctx.meta.update(
            cpr=f.cpr,
            cmd=f.cmd,
            cpr_ci=list(f.cpr_ci),
            cmd_ci=list(f.cmd_ci),
            edge_count=c.edge_count,
            target_edges=f.target_edges,
            target_edges_ungrouped=f.target_edges_ungrouped,
            clean=f.clean,
            corrupted=f.corrupted,
        )
    tables[0]["in_circuit"] = circuit[graph.real].tolist()  # edge_rows's order: the edges row-major
    if ctx.run_dir is not None:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(ctx.run_dir / CIRCUIT_FILE, graph.to_json(torch.nan_to_num(scores), circuit))
    return results.conform(pd.concat(tables, ignore_index=True))


def convergence(scores: Tensor, doubled: Tensor, graph: EdgeGraph, steps: int) -> dict:
    """How far EAP-IG's scores move from m to 2m interpolation steps: Pearson r over the edges, the
    largest change relative to the largest |score|, and the share of the top 1% of edges by |score| at m
    steps still in the top 1% at 2m."""
    a, b = torch.nan_to_num(scores)[graph.real].double(), torch.nan_to_num(doubled)[graph.real].double()
    k = max(1, graph.n_edges // 100)
    top_a, top_b = set(a.abs().topk(k).indices.tolist()), set(b.abs().topk(k).indices.tolist())
    return {
        "steps": [steps, 2 * steps],
        "pearson": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
        "max_change_over_max_score": float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)),
        "top_1pct_kept": len(top_a & top_b) / k,
    }


def exact_check(ctx: RunContext, graph: EdgeGraph, scores: Tensor, info: dict) -> pd.DataFrame:
    """Exact scores of a sample of edges (the top half by |score|, the rest drawn at random), and the
    Pearson r between the method's scores and the exact ones on it (meta.json: exact_check_pearson)."""
    k = min(ctx.options.exact_check, graph.n_edges)
    ranked = graph.ranking(torch.nan_to_num(scores)).tolist()
    top = ranked[: k // 2]
    rest = random.Random(ctx.cfg.seed).sample(ranked[k // 2 :], k - len(top))
    which = torch.zeros_like(graph.real)
    which.view(-1)[top + rest] = True
    exact = exact_scores(ctx.get_model(), ctx.get_task(), ctx.get_data(), graph, which, ctx.cfg.engine.chunk_mb)
    sample = which & graph.real
    r = float(np.corrcoef(scores[sample].numpy(), exact[sample].numpy())[0, 1]) if k > 1 else float("nan")
    ctx.meta["exact_check_pearson"] = r
    ctx.meta["exact_check_edges"] = int(sample.sum())
    return edge_rows(graph, exact, "exact", info, sample)


def edge_rows(graph: EdgeGraph, scores: Tensor, method: str, info: dict, mask: Tensor | None = None) -> pd.DataFrame:
    pairs = (graph.real if mask is None else mask & graph.real).nonzero()  # [edges, 2]: sender, receiver
    s, r = pairs[:, 0].numpy(), pairs[:, 1].numpy()
    n = len(s)
    if not n:
        return pd.DataFrame()

    def each(values: list, at: np.ndarray) -> list:  # a node's value, per edge: one C-level gather, no Python loop
        column = np.empty(len(values), dtype=object)
        column[:] = values
        return column[at].tolist()

    senders, receivers = graph.senders, graph.receivers
    sender_names, receiver_names = [x.name for x in senders], [x.name for x in receivers]
    columns = {
        **{key: [value] * n for key, value in info.items()},
        "intervention": ["edge"] * n,
        "method": [method] * n,
        "layer": each([None if x.kind == "logits" else x.layer for x in receivers], r),
        "head": each([x.head for x in receivers], r),
        "position": [None] * n,
        "hook": each([receiver_hook(graph, x) for x in receivers], r),
        "sender_hook": each([sender_hook(x) for x in senders], s),
        "value": scores[pairs[:, 0], pairs[:, 1]].double().tolist(),
        "edge": [f"{a}->{b}" for a, b in zip(each(sender_names, s), each(receiver_names, r))],
        "sender": each(sender_names, s),
        "receiver": each(receiver_names, r),
        "sender_layer": each([None if x.kind == "input" else x.layer for x in senders], s),
        "sender_head": each([x.head for x in senders], s),
        "receiver_input": each([x.kind for x in receivers], r),
    }
    return pd.DataFrame(columns)


# TransformerLens's names of the graph's nodes, as EAP-IG's TransformerLens code hooks them: a sender's
# output as it enters the residual stream, a receiver's input as it reads the stream (before its norm)
SENDER_SITES = {"input": "resid_pre", "head": "result", "mlp": Site.mlp}
RECEIVER_SITES = {"q": "q_input", "k": "k_input", "v": "v_input", "mlp": "mlp_in", "logits": "resid_post"}


def sender_hook(sender: Sender) -> str | None:
    return hook_name(SENDER_SITES[sender.kind], max(sender.layer, 0))  # the input: what block 0 reads


def receiver_hook(graph: EdgeGraph, receiver: Receiver) -> str | None:
    # the logits read the stream the last block leaves
    layer = graph.n_layers - 1 if receiver.kind == "logits" else receiver.layer
    return hook_name(RECEIVER_SITES[receiver.kind], layer)


def node_rows(graph: EdgeGraph, scores: Tensor, method: str, info: dict) -> pd.DataFrame:
    rows = [
        {
            **info,
            "intervention": "node",
            "method": method,
            "layer": None if s.kind == "input" else s.layer,
            "head": s.head,
            "position": None,
            "hook": sender_hook(s),
            "value": float(scores[i]),
            "node": s.name,
        }
        for i, s in enumerate(graph.senders)
    ]
    return pd.DataFrame(rows)


def circuit_row(info: dict, method: str) -> dict:
    """What every row about the circuit as a whole (intervention "circuit") shares."""
    return {**info, "intervention": "circuit", "method": method, "layer": None, "head": None, "position": None}


def faithfulness_rows(f: Faithfulness, method: str, info: dict) -> pd.DataFrame:
    base = circuit_row(info, method)
    rows = [
        {
            **base,
            "metric": "faithfulness",
            "value": p.faithfulness,
            "fraction": p.fraction,
            "n_edges": p.n_edges,
            "n_edges_ungrouped": p.n_edges_ungrouped,
            "ranking": p.ranking,
        }
        for p in f.points
    ]
    rows += [
        {**base, "metric": name, "value": value, "ci_low": ci[0], "ci_high": ci[1]}
        for name, value, ci in (
            ("cpr", f.cpr, f.cpr_ci),
            ("cmd", f.cmd, f.cmd_ci),
            ("target_edges", f.target_edges, (None, None)),
            ("target_edges_ungrouped", f.target_edges_ungrouped, (None, None)),
            ("target_faithfulness", f.target_faithfulness, (None, None)),
            ("clean", f.clean, (None, None)),
            ("corrupted", f.corrupted, (None, None)),
        )
    ]
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """The strongest edges (or nodes) per method, then each method's faithfulness summary."""
    df = aggregated(df)
    column = "edge" if "edge" in df else "node"
    items = df[df["intervention"] == column]
    for method, rows in items.groupby("method", sort=False):
        top = rows.assign(_size=rows["value"].abs()).nlargest(max_rows, "_size")
        table = Table(
            title=f"{df['model'].iloc[0]} on {df['task'].iloc[0]} ({int(df['n'].iloc[0])} prompts): {method}, "
            f"{len(top)} of {len(rows)} {column}s by |change in {rows['metric'].iloc[0]}|"
        )
        shown = [column, "value"] + (["in_circuit"] if "in_circuit" in rows else [])
        for col in shown:
            table.add_column(col, justify="left" if col == column else "right")
        for _, r in top.iterrows():
            table.add_row(
                str(r[column]), f"{r['value']:.4f}", *([str(r["in_circuit"])] if "in_circuit" in rows else [])
            )
        console.print(table)
    faithfulness = df[(df["intervention"] == "circuit") & (df["metric"] != "faithfulness")]
    for method, rows in faithfulness.groupby("method", sort=False):
        values = dict(zip(rows["metric"], rows["value"]))
        if "cpr" not in values:  # study.faithfulness=false: the graph's sizes alone
            continue
        bounds = rows.reindex(columns=["metric", "ci_low", "ci_high"])  # a summarised table may hold no interval
        ci = {m: f" [{lo:.3f}, {hi:.3f}]" if pd.notna(lo) else "" for m, lo, hi in bounds.itertuples(index=False)}
        console.print(
            f"{method}: CPR {values['cpr']:.3f}{ci['cpr']}, CMD {values['cmd']:.3f}{ci['cmd']}; "
            f"{int(values['target_edges'])} edges "
            f"recover {values['target_faithfulness']:.3f} of the clean-corrupted gap "
            f"({values['clean']:.3f} vs {values['corrupted']:.3f})",
            highlight=False,
        )


STUDY = Study(
    name="circuit",
    description="edge (or node) circuits from counterfactual prompts: EAP, EAP-IG, exact; faithfulness",
    run=run,
    summary=summary,
    reads=("train", "engine"),
    schema=CircuitOptions,
    figures="circuit",
    short_form="method",
)
