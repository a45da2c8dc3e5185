"""study=audit (`headlab audit RUN_DIR`): is a circuit *the* circuit? Stability, rivals and the circuit
hypothesis tests of Shi et al. 2024 (arXiv 2410.13032) for an edge circuit or a set of heads.

The circuit: `study.circuit`, a circuit.json (ours, EAP-IG's or MIB's layout: its in_graph edges and their
scores), a run directory holding one, or heads (`[a9.h6,a10.h0]`, level heads); unset, the smallest
circuit by `study.method`'s scores reaching `study.target` of the clean-corrupted gap on the run's prompts
(as study=circuit reports it). Every circuit is then measured exactly (edges/evaluate.py) on
`study.held_out` prompts drawn apart from those it was found on:

1. stability (edges/audit.py): the units scored again over bootstrap resamples of the prompts, other
   prompt draws, each half of the templates (scored on one half, measured on the other's held-out
   prompts), other methods and twice the steps; each variant's top units at the found circuit's size,
   their Jaccard index with it (an interval over resamples and draws), their faithfulness, and each unit's
   share of the resampled circuits that keep it;
2. rivals: disjoint circuits of the same size (edges/audit.rivals), the best one's faithfulness and the
   margin to the found circuit with a paired bootstrap interval: unique at its size where it is above 0;
3. the hypothesis tests (edges/hypothesis.py): equivalence, independence, minimality.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .. import results
from ..config import run_info
from ..config_rules import COUNT, NATURAL, SHARE, Each, Known, OneOf, Range, setting
from ..edges import hypothesis
from ..edges.audit import LEVELS, Rival, Scale, Units, Variant, interval, jaccard, keep_shares, margin, random_units
from ..edges.audit import rivals as find_rivals
from ..edges.eap import doubled_steps
from ..edges.evaluate import circuit_metric, clean_and_corrupted
from ..edges.graph import KV_EDGES, EdgeGraph
from ..edges.methods import Budget, method_names
from ..edges.methods import get as get_method
from ..edges.postnorm import POST_NORM_RULES
from ..edges.record import metric_column
from ..errors import UsageError
from ..progress import progress_bar
from ..tables import head_of
from ..tasks import TaskData
from .circuit import CIRCUIT_FILE
from .context import EVAL_SEED_OFFSET, RunContext
from .study import Study, StudyOptions
from .summary import console

HELD_OUT_OFFSET = 7_919  # the held-out prompts' seed, apart from the run's prompts and the other draws
DRAW_OFFSET = 104_729  # the s-th other draw of the prompts: seed + EVAL_SEED_OFFSET + s * DRAW_OFFSET


@dataclass
class AuditOptions(StudyOptions):
    """`study=audit`: stability, rivals and Shi et al.'s hypothesis tests for one circuit."""

    name: str = "audit"
    # a circuit.json (ours, EAP-IG's or MIB's layout) or a run dir holding one; None: found here (or heads)
    circuit: str | None = None
    heads: list[str] | None = None  # a circuit of heads instead ([a9.h6,a10.h0] or [L9H6,L10H0]): level heads
    level: str = setting("edges", OneOf(LEVELS))  # the units of a circuit found here or read from a file
    method: str = setting("eap_ig", Known(method_names))  # the scores the circuit and its rivals are cut from
    steps: int = setting(5, COUNT)
    ig_steps_from: int | None = setting(None, Range(0, 1, integer=True))
    target: float = setting(0.8, SHARE)  # where the circuit is found here: the share of the gap it recovers
    kv_edges: str = setting("ungrouped", OneOf(KV_EDGES))
    post_norm: str = setting("mib", OneOf(POST_NORM_RULES))
    held_out: int = setting(16, COUNT)  # prompts every circuit is measured on, drawn apart
    resamples: int = setting(5, NATURAL)  # bootstrap resamples of the prompts, each scored again
    draws: int = setting(2, NATURAL)  # other draws of task.n_prompts prompts, each scored again
    templates: bool = True  # scored on half of the templates, measured on the other half (tasks with groups)
    # eap_ig_activations takes one gradient run per node and step (61 x 5 on smollm2-135m): named, not default
    methods: list[str] = setting(factory=lambda: ["eap", "eap_ig"], rule=Each(Known(method_names)))
    exact_limit: int = setting(2000, NATURAL)  # exact patching as a variant only on graphs this small
    twice_the_steps: bool = True  # an integrating method's scores at 2 * steps as a variant
    rivals: int = setting(3, NATURAL)  # rounds of the disjoint rival search
    epsilon: float = setting(hypothesis.EPSILON, SHARE)  # equivalence's margin
    permutations: int = setting(1000, COUNT)  # independence's permutation test
    n_random: int = setting(100, COUNT)  # minimality: random units outside the circuit
    quantile: float = setting(hypothesis.QUANTILE, SHARE)  # minimality: the share of random units to beat
    max_units: int = setting(30, COUNT)  # minimality: the circuit's units tested, largest |score| first
    prompts_per_pass: int = setting(16, COUNT)
    n_boot: int = setting(1000, NATURAL)  # the margin's bootstrap


@dataclass
class Found:
    units: Units
    scores: Tensor  # [units] float64
    chosen: Tensor  # [units] bool
    source: str
    label: str  # what the audited circuit is, in a few words (the table's `audited` column)
    edge_scores: Tensor | None = field(default=None, repr=False)  # [senders, receivers] where scored here


class Measure:
    """Circuits measured exactly on the held-out prompts (the clean and corrupted runs recorded once)."""

    def __init__(self, ctx: RunContext, graph: EdgeGraph, data: TaskData):
        self.model, self.task, self.data, self.graph = ctx.get_model(), ctx.get_task(), data, graph
        self.runs = clean_and_corrupted(self.model, graph, data)
        self.calls = 0
        self.scale = Scale(self(graph.real.clone()), self(torch.zeros_like(graph.real)))

    def __call__(self, mask: Tensor) -> np.ndarray:
        self.calls += 1
        metric = circuit_metric(self.model, self.task, self.data, self.graph, mask, self.runs)
        return metric.double().cpu().numpy()


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, c = ctx.cfg, ctx.options
    metric_column(ctx.get_task())
    model, task = ctx.get_model(), ctx.get_task()
    ctx.get_data()  # the run's own prompts, placed where the model reads them
    graph = EdgeGraph.of(model, c.post_norm, c.kv_edges)
    budget = Budget(c.steps, c.prompts_per_pass, c.ig_steps_from, cfg.engine.chunk_mb, False)
    held = task.build(c.held_out, seed=cfg.seed + EVAL_SEED_OFFSET + HELD_OUT_OFFSET, model=model)
    held = held.to(str(model.input_device))
    with ctx.timed("held_out_runs"):
        measure = Measure(ctx, graph, held)
    with ctx.timed("found"):
        found = found_circuit(ctx, graph, budget)
    units, size = found.units, int(found.chosen.sum())
    if size == 0 or size == units.count:
        raise UsageError(f"the circuit holds {size} of {units.count} {units.level}: nothing to audit")
    info = {**run_info(cfg), "n": held.n, "intervention": "audit", "method": c.method, "audited": found.label}
    found_metric = measure(units.to_mask(found.chosen))
    rows = [{**info, "metric": "size", "value": size}, {**info, "metric": "units", "value": units.count}]
    rows.append({**info, "metric": "faithfulness", "variant": "found", "value": measure.scale.share(found_metric)})
    with ctx.timed("stability"):
        variants = stability(ctx, graph, budget, found, measure, held)
    rows += variant_rows(info, variants, found)
    with ctx.timed("rivals"):
        rivals = find_rivals(units, found.scores, found.chosen, measure, measure.scale, c.rivals)
    rows += rival_rows(info, rivals, found_metric, measure.scale, c.n_boot, cfg.seed)
    with ctx.timed("tests"):
        tests, mini = hypothesis_tests(c, found, found_metric, measure, cfg.seed)
    if np.array_equal(found_metric, measure.scale.clean):
        ctx.note("the circuit scores as the model on every prompt: equivalence (a share of prompts) cannot tell")
    rows += [
        {**info, "metric": f"{t.test}_p", "value": t.p_value, "statistic": t.statistic, "rejected": t.rejected}
        for t in tests
    ]
    tested = units_tested(found, c.max_units)
    rows += [
        {
            **info,
            "intervention": "minimality",
            "unit": units.names[u],
            "metric": "knockout_effect",
            "value": e,
            "p_value": p,
        }
        for u, e, p in zip(tested, mini.effects.tolist(), mini.p_values.tolist())
    ]
    shares = keep_shares([v.chosen for v in variants if v.kind in ("resample", "seed")] or [found.chosen])
    kept = (shares > 0) | found.chosen
    rows += [
        {
            **info,
            "intervention": "keep_share",
            "unit": units.names[u],
            "metric": "keep_share",
            "value": float(shares[u]),
            "in_circuit": bool(found.chosen[u]),
        }
        for u in kept.nonzero().flatten().tolist()
    ]
    ctx.meta.update(
        circuit=found.source,
        level=units.level,
        size=size,
        held_out_prompts=held.n,
        evaluations=measure.calls,
        tests={t.test: {"p_value": t.p_value, "rejected": t.rejected, "meaning": t.meaning} for t in tests},
        unique=bool(rivals) and rival_margin_above_zero(rows),
    )
    rows += overlap_rows(info, found, variants, rivals)
    return results.conform(pd.DataFrame(rows))


def found_circuit(ctx: RunContext, graph: EdgeGraph, budget: Budget) -> Found:
    c = ctx.options
    if c.heads:
        return heads_circuit(ctx, graph, budget, [head_unit(str(h)) for h in c.heads], "heads given")
    units = Units(graph, c.level)
    if c.circuit and (Path(c.circuit) / "meta.json").is_file() and not (Path(c.circuit) / CIRCUIT_FILE).is_file():
        return heads_circuit(ctx, graph, budget, classed_heads(Path(c.circuit)), "heads of the IOI classes")
    if c.circuit:
        path = Path(c.circuit)
        path = path / CIRCUIT_FILE if path.is_dir() else path
        if not path.is_file():
            raise UsageError(f"study.circuit={c.circuit}: neither a circuit.json nor a run dir holding one")
        edge_scores, mask = graph.from_json(json.loads(path.read_text()))
        if not mask.any():
            raise UsageError(f"{path}: no edge is in_graph")
        if not torch.nan_to_num(edge_scores).any():  # a circuit without scores: its rivals are cut from ours
            edge_scores = score(ctx, graph, budget, c.method, ctx.get_data())
        return Found(units, units.scores(edge_scores), units.of_mask(mask), str(path), f"{units.level} of {path.name}")
    edge_scores = score(ctx, graph, budget, c.method, ctx.get_data())
    scores = units.scores(edge_scores)
    with ctx.timed("found_runs"):
        own = Measure(ctx, graph, ctx.get_data())  # found on the run's own prompts, as study=circuit finds it
    how = f"{units.level} found by {c.method} at {c.target}"
    return Found(units, scores, smallest(units, scores, own, c.target), how, how, edge_scores)


RUN_KEYS = ("model", "task", "seed", "device", "engine", "train")  # what of a run's overrides an audit keeps
GRAPH_OPTIONS = ("method", "steps", "ig_steps_from", "kv_edges", "post_norm")  # a circuit run's, kept alike


def audit_overrides(run_dir: Path) -> list[str]:
    """`headlab audit RUN_DIR`: the overrides of `headlab run study=audit` on the run's model, task and
    seed, auditing its circuit (a circuit run's circuit.json) or its head classes (an ioi_classes run's)."""
    import yaml

    hydra = run_dir / ".hydra"
    try:
        given = yaml.safe_load((hydra / "overrides.yaml").read_text()) or []
        study = (yaml.safe_load((hydra / "config.yaml").read_text()) or {}).get("study", {})
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"{run_dir}: not a headlab run dir (its .hydra/ cannot be read: {e})") from e
    kept = [o for o in given if o.split("=")[0].lstrip("+").split(".")[0] in RUN_KEYS]
    if study.get("name") == "circuit":
        if not (run_dir / CIRCUIT_FILE).is_file():
            raise UsageError(f"{run_dir}: a circuit run without {CIRCUIT_FILE} (study.level=nodes?): nothing to audit")
        options = [f"study.{k}={'null' if study[k] is None else study[k]}" for k in GRAPH_OPTIONS if k in study]
        return ["study=audit", *kept, *options, f"study.circuit={run_dir.resolve()}"]
    if study.get("name") == "ioi_classes":
        return ["study=audit", *kept, f"study.circuit={run_dir.resolve()}"]
    raise UsageError(f"{run_dir}: a {study.get('name')} run; audit reads a circuit or an ioi_classes run")


def heads_circuit(ctx: RunContext, graph: EdgeGraph, budget: Budget, given: list[str], label: str) -> Found:
    units = Units(graph, "heads")
    unknown = sorted(set(given) - set(units.names))
    if unknown:
        raise UsageError(f"study.heads: {', '.join(unknown)} not heads of this model")
    edge_scores = score(ctx, graph, budget, ctx.options.method, ctx.get_data())
    chosen = torch.tensor([n in given for n in units.names])
    return Found(units, units.scores(edge_scores), chosen, "heads " + ",".join(given), label, edge_scores)


def classed_heads(run_dir: Path) -> list[str]:
    """The heads an ioi_classes run put in a class (its meta.json's `classes`, "layer.head")."""
    try:
        classes = json.loads((run_dir / "meta.json").read_text()).get("classes") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{run_dir}: its meta.json cannot be read ({e})") from e
    heads = [f"a{h.split('.')[0]}.h{h.split('.')[1]}" for members in classes.values() for h in members]
    if not heads:
        raise UsageError(f"{run_dir}: neither a circuit.json nor an ioi_classes run with classed heads")
    return heads


def head_unit(name: str) -> str:
    """A head's unit name (a9.h6) from either spelling (a9.h6, L9H6)."""
    try:
        layer, head = head_of(name)
    except ValueError:
        return name
    return f"a{layer}.h{head}"


def smallest(units: Units, scores: Tensor, measure: Measure, target: float) -> Tensor:
    """The smallest top-k circuit reaching `target` where `measure` measures, by bisection over k
    (faithfulness taken as rising with k, as edges/faithfulness.smallest takes it)."""
    low, high = 0, units.count
    best = units.top(scores, high)
    while high - low > 1:
        mid = (low + high) // 2
        chosen = units.top(scores, mid)
        if measure.scale.share(measure(units.to_mask(chosen))) >= target:
            high, best = mid, chosen
        else:
            low = mid
    return best


def score(ctx: RunContext, graph: EdgeGraph, budget: Budget, method: str, data: TaskData) -> Tensor:
    return get_method(method).edges(ctx.get_model(), ctx.get_task(), data, graph, budget)


@dataclass
class Planned:
    """A variant to score: its name and kind, the prompts and method it is scored with, and the held-out
    prompts it is measured on (None: all)."""

    name: str
    kind: str
    prompts: TaskData
    method: str
    held_rows: np.ndarray | None = None


def planned(ctx: RunContext, graph: EdgeGraph, held: TaskData) -> list[Planned]:
    cfg, c = ctx.cfg, ctx.options
    model, task, data = ctx.get_model(), ctx.get_task(), ctx.get_data()
    rng = np.random.default_rng(cfg.seed)
    plan = [
        Planned(f"resample_{r + 1}", "resample", data.take(torch.as_tensor(rng.integers(0, data.n, data.n))), c.method)
        for r in range(c.resamples)
    ]
    for s in range(1, c.draws + 1):
        other = task.build(data.n, seed=cfg.seed + EVAL_SEED_OFFSET + s * DRAW_OFFSET, model=model)
        plan.append(Planned(f"draw_{s + 1}", "seed", other.to(str(model.input_device)), c.method))
    if c.templates and data.groups is not None and held.groups is not None and len(data.groups.unique()) > 1:
        names = data.groups.unique().sort().values
        for half, (mine, theirs) in zip("ab", ((names[::2], names[1::2]), (names[1::2], names[::2]))):
            rows = torch.isin(data.groups, mine).nonzero().flatten()
            held_rows = torch.isin(held.groups, theirs).nonzero().flatten().numpy()
            if len(rows) and len(held_rows):
                plan.append(Planned(f"templates_{half}", "templates", data.take(rows), c.method, held_rows))
    for m in c.methods:
        if m == "exact" and graph.n_edges > c.exact_limit:
            ctx.note(f"exact patching left out of the methods: {graph.n_edges} edges > study.exact_limit")
            continue
        plan.append(Planned(f"method_{m}", "method", data, m))
    return plan


def stability(
    ctx: RunContext, graph: EdgeGraph, budget: Budget, found: Found, measure: Measure, held: TaskData
) -> list[Variant]:
    c = ctx.options
    plan = planned(ctx, graph, held)
    model, task, data = ctx.get_model(), ctx.get_task(), ctx.get_data()
    twice = c.twice_the_steps and get_method(c.method).integrates
    base = found.edge_scores  # the method's own scores on the run's prompts, where it found the circuit
    variants: list[Variant] = []
    found_heads = found.units.heads_of(found.chosen)
    size = int(found.chosen.sum())
    with progress_bar("audit: stability", total=len(plan) + twice, enabled=ctx.show_progress) as bar:
        for p in plan:
            started = time.perf_counter()
            if p.kind == "method" and p.method == c.method:
                base = score(ctx, graph, budget, p.method, p.prompts) if base is None else base
                edge_scores = base
            else:
                edge_scores = score(ctx, graph, budget, p.method, p.prompts)
            variants.append(variant(p.name, p.kind, edge_scores, found, size, found_heads, measure, p.held_rows))
            ctx.meta.setdefault("variant_seconds", {})[p.name] = round(time.perf_counter() - started, 1)
            bar.update(len(variants))
        if twice:
            base = score(ctx, graph, budget, c.method, data) if base is None else base
            steps, ppp, first = c.steps, c.prompts_per_pass, c.ig_steps_from
            doubled = doubled_steps(model, task, data, graph, c.method, base, steps, ppp, False, first)
            variants.append(variant(f"steps_{2 * c.steps}", "steps", doubled, found, size, found_heads, measure, None))
            bar.update(len(variants))
    return variants


def variant(
    name: str,
    kind: str,
    edge_scores: Tensor,
    found: Found,
    size: int,
    found_heads: Tensor,
    measure: Measure,
    held_rows: np.ndarray | None,
) -> Variant:
    units = found.units
    chosen = units.top(units.scores(edge_scores), size)
    v = Variant(name, kind, chosen)
    v.jaccard, v.jaccard_heads = jaccard(chosen, found.chosen), jaccard(units.heads_of(chosen), found_heads)
    v.faithfulness = measure.scale.share(measure(units.to_mask(chosen)), held_rows)
    return v


def units_tested(found: Found, max_units: int) -> list[int]:
    inside = found.chosen.nonzero().flatten()
    order = torch.argsort(found.scores[inside].abs(), descending=True, stable=True)
    return inside[order[:max_units]].tolist()


def hypothesis_tests(
    c: AuditOptions, found: Found, found_metric: np.ndarray, measure: Measure, seed: int
) -> tuple[list[hypothesis.Outcome], hypothesis.Minimality]:
    units, model_metric = found.units, measure.scale.clean
    complement = measure(units.to_mask(~found.chosen))
    knocked = []
    for u in units_tested(found, c.max_units):
        without = found.chosen.clone()
        without[u] = False
        knocked.append(measure(units.to_mask(without)))
    added = []
    for u in random_units(~found.chosen, c.n_random, seed):
        more = found.chosen.clone()
        more[u] = True
        added.append(measure(units.to_mask(more)))
    mini = hypothesis.minimality(found_metric, np.stack(knocked), np.stack(added), c.quantile)
    tests = [
        hypothesis.equivalence(model_metric, found_metric, c.epsilon),
        hypothesis.independence(model_metric, complement, c.permutations, seed),
        mini.outcome,
    ]
    return tests, mini


def variant_rows(info: dict, variants: list[Variant], found: Found) -> list[dict]:
    rows = []
    for v in variants:
        base = {**info, "variant": v.name, "kind": v.kind}
        rows += [
            {**base, "metric": "jaccard", "value": v.jaccard},
            {**base, "metric": "jaccard_heads", "value": v.jaccard_heads},
            {**base, "metric": "faithfulness", "value": v.faithfulness},
        ]
    for kind in dict.fromkeys(v.kind for v in variants):
        values = [v.jaccard for v in variants if v.kind == kind]
        low, high = interval(values)
        rows.append(
            {
                **info,
                "kind": kind,
                "metric": "jaccard_mean",
                "value": float(np.mean(values)),
                "ci_low": low,
                "ci_high": high,
            }
        )
    return rows


def rival_rows(
    info: dict, rivals: list[Rival], found_metric: np.ndarray, scale: Scale, n_boot: int, seed: int
) -> list[dict]:
    rows = []
    for r in rivals:
        base = {**info, "variant": f"rival_{r.round}", "kind": "rival"}
        rows += [
            {**base, "metric": "faithfulness", "value": r.faithfulness},
            {**base, "metric": "shared_units", "value": r.shared_units},
            {**base, "metric": "jaccard_heads", "value": r.jaccard_heads},
            {**base, "metric": "rival_size", "value": int(r.chosen.sum())},
        ]
    if rivals:
        best = max(rivals, key=lambda r: r.faithfulness)
        value, low, high = margin(found_metric, best.per_prompt, scale, n_boot, seed)
        rows.append(
            {
                **info,
                "variant": f"rival_{best.round}",
                "kind": "rival",
                "metric": "margin",
                "value": value,
                "ci_low": low,
                "ci_high": high,
            }
        )
    return rows


def rival_margin_above_zero(rows: list[dict]) -> bool:
    (row,) = [r for r in rows if r.get("metric") == "margin"]
    return bool(row["ci_low"] > 0) if np.isfinite(row["ci_low"]) else bool(row["value"] > 0)


def overlap_rows(info: dict, found: Found, variants: list[Variant], rivals: list[Rival]) -> list[dict]:
    """Pairwise Jaccard of the found circuit's, every variant's and every rival's units (the report's matrix)."""
    named = [("found", found.chosen), *((v.name, v.chosen) for v in variants)]
    named += [(f"rival_{r.round}", r.chosen) for r in rivals]
    return [
        {**info, "intervention": "overlap", "variant": a, "other": b, "metric": "jaccard", "value": jaccard(x, y)}
        for a, x in named
        for b, y in named
    ]


def summary(df: pd.DataFrame, max_rows: int) -> None:
    audit = df[df["intervention"] == "audit"]
    values = dict(zip(audit["metric"], audit["value"]))
    found = audit[(audit["metric"] == "faithfulness") & (audit["variant"] == "found")]["value"].iloc[0]
    size, units = int(values["size"]), int(values["units"])
    console.print(
        f"{df['model'].iloc[0]} on {df['task'].iloc[0]}: a circuit of {size} of {units} units,"
        f" faithfulness {found:.3f} on {int(df['n'].iloc[0])} held-out prompts",
        highlight=False,
        markup=False,
    )
    for _, r in audit[audit["metric"] == "jaccard_mean"].iterrows():
        console.print(
            f"  overlap over {r['kind']}: Jaccard {r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
            highlight=False,
            markup=False,
        )
    margin_rows = audit[audit["metric"] == "margin"]
    if len(margin_rows):
        m = margin_rows.iloc[0]
        console.print(
            f"  best disjoint rival ({m['variant']}): margin {m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]",
            highlight=False,
            markup=False,
        )
    for _, r in audit[audit["metric"].str.endswith("_p")].iterrows():
        verdict = "rejected" if r["rejected"] else "not rejected"
        console.print(f"  {r['metric'][:-2]}: p = {r['value']:.3g} ({verdict})", highlight=False, markup=False)


STUDY = Study(
    name="audit",
    description="is it the circuit? stability, disjoint rivals and Shi et al.'s hypothesis tests",
    run=run,
    summary=summary,
    reads=("train", "engine"),
    schema=AuditOptions,
    figures="audit",
)
