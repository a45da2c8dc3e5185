"""study=audit (`headlab audit RUN_DIR`): is a circuit *the* circuit? Stability, rivals and the circuit
hypothesis tests of Shi et al. 2024 (arXiv 2410.13032) for an edge circuit or a set of heads.

The circuit: `study.circuit`, a circuit.json (ours, EAP-IG's or MIB's layout: its in_graph edges and their
scores), a run directory holding one, or an ioi_classes run (its classed heads); `study.heads`, heads
(`[a9.h6,a10.h0]`); unset, the smallest circuit by `study.method`'s scores reaching `study.target` of the
clean-corrupted gap on the run's prompts, by bisection over its size after pruning (the search
study=circuit makes: edges/faithfulness.reaching). Every circuit is then measured exactly
(edges/evaluate.py) on `study.held_out` prompts drawn apart from those it was found on:

1. stability (edges/audit.py): the units scored again over bootstrap resamples of the prompts, other
   prompt draws, each half of the templates (scored on one half, measured on the other's held-out
   prompts), other methods and twice the steps; each variant's top units at the found circuit's size and
   (`study.at_target`) its own smallest circuit reaching the target on its own prompts, their Jaccard
   index with the found circuit (an interval over resamples and draws), their faithfulness, and each unit's
   share of the resampled and redrawn circuits that keep it;
2. rivals: disjoint circuits of the same size (edges/audit.rivals), the best one's faithfulness and the
   margin to the found circuit with a paired bootstrap interval: unique at its size where it is above 0;
3. the hypothesis tests (edges/hypothesis.py): equivalence, independence, minimality.

tests/test_audit.py runs it on hand-set transformers with a planted circuit and a planted twin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
from ..edges.audit import LEVELS, Units, Variant, jaccard, keep_shares, random_units, rivals
from ..edges.eap import doubled_steps
from ..edges.faithfulness import Evaluator, reaching
from ..edges.graph import KV_EDGES, EdgeGraph
from ..edges.methods import Budget, method_names
from ..edges.methods import get as get_method
from ..edges.postnorm import POST_NORM_RULES
from ..edges.record import metric_column
from ..errors import UsageError
from ..progress import progress_bar
from ..tasks import TaskData
from .audit_rows import keep_share_rows, overlap_rows, rival_rows, summary, test_rows, unique, variant_rows
from .audit_sources import circuit_file, classed_heads, head_unit, is_classes_run
from .context import EVAL_SEED_OFFSET, RunContext
from .study import Study, StudyOptions

RIVAL_SCORES = ("both", "rescored", "cut")
HELD_OUT_OFFSET = 7_919  # the held-out prompts' seed, apart from the run's prompts and the other draws
DRAW_OFFSET = 104_729  # the s-th other draw of the prompts: seed + EVAL_SEED_OFFSET + s * DRAW_OFFSET


@dataclass
class AuditOptions(StudyOptions):
    """`study=audit`: stability, rivals and Shi et al.'s hypothesis tests for one circuit."""

    name: str = "audit"
    # a circuit.json (ours, EAP-IG's or MIB's layout), a run dir holding one, or an ioi_classes run's dir;
    # None: found here (or study.heads)
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
    # each variant's own smallest circuit reaching study.target on its own prompts, measured and compared too
    at_target: bool = True
    rivals: int = setting(3, NATURAL)  # rounds of the disjoint rival search
    # each round's rival built from the found circuit's scores (cut), from the units scored again with every
    # earlier circuit's units forbidden (rescored: eap, eap_ig), or both, the more faithful kept
    rival_scores: str = setting("both", OneOf(RIVAL_SCORES))
    epsilon: float = setting(hypothesis.EPSILON, SHARE)  # equivalence's margin
    permutations: int = setting(1000, COUNT)  # independence's permutation test
    n_random: int = setting(100, COUNT)  # minimality: random units outside the circuit
    quantile: float = setting(hypothesis.QUANTILE, SHARE)  # minimality: the share of random units to beat
    # minimality: the circuit's units tested, smallest |score| first (the likeliest to be redundant); 0: all
    max_units: int = setting(30, NATURAL)
    prompts_per_pass: int = setting(16, COUNT)
    n_boot: int = setting(1000, NATURAL)  # the margin's bootstrap


class Measure(Evaluator):
    """The faithfulness Evaluator of one set of prompts (its clean and corrupted runs recorded once), counting
    the audit's exact evaluations."""

    def __init__(self, audit: Audit, data: TaskData):
        self.audit = audit
        super().__init__(audit.model, audit.task, data, audit.graph)

    def per_prompt_many(self, circuits: list[Tensor]) -> list[np.ndarray]:
        self.audit.evaluations += len(circuits)
        return super().per_prompt_many(circuits)

    def faithfulness(self, mask: Tensor, rows: np.ndarray | None = None) -> float:
        """The circuit's share of the clean-corrupted gap over the prompts `rows` (None: all)."""
        return self.share(self.per_prompt(mask), rows)


@dataclass
class Found:
    units: Units
    scores: Tensor  # [units] float64
    chosen: Tensor  # [units] bool
    source: str
    label: str  # what the audited circuit is, in a few words (the table's `audited` column)
    edge_scores: Tensor | None = field(default=None, repr=False)  # [senders, receivers] where scored here


class Audit:
    """One audit's shared state: the model's graph, the method's budget, each prompt set's recorded runs."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.c, cfg = ctx, ctx.options, ctx.cfg
        metric_column(ctx.get_task())
        self.model, self.task, self.data = ctx.get_model(), ctx.get_task(), ctx.get_data()
        self.graph = EdgeGraph.of(self.model, self.c.post_norm, self.c.kv_edges)
        self.budget = Budget(self.c.steps, self.c.prompts_per_pass, self.c.ig_steps_from, cfg.engine.chunk_mb)
        self.evaluations = 0
        self._measures: dict[int, Measure] = {}
        held = self.task.build(self.c.held_out, seed=cfg.seed + EVAL_SEED_OFFSET + HELD_OUT_OFFSET, model=self.model)
        self.held = self.measure(held.to(str(self.model.input_device)))

    def measure(self, prompts: TaskData) -> Measure:
        if id(prompts) not in self._measures:
            with self.ctx.timed("recorded_runs"):
                self._measures[id(prompts)] = Measure(self, prompts)
        return self._measures[id(prompts)]

    def score(self, method: str, prompts: TaskData) -> Tensor:
        return get_method(method).edges(self.model, self.task, prompts, self.graph, self.budget)

    def draw(self, s: int) -> TaskData:
        cfg = self.ctx.cfg
        other = self.task.build(self.data.n, seed=cfg.seed + EVAL_SEED_OFFSET + s * DRAW_OFFSET, model=self.model)
        return other.to(str(self.model.input_device))


def run(ctx: RunContext) -> pd.DataFrame:
    audit, c, seed = Audit(ctx), ctx.options, ctx.cfg.seed
    held = audit.held
    with ctx.timed("found"):
        found = found_circuit(audit)
    units, size = found.units, int(found.chosen.sum())
    if size == 0 or size == units.count:
        raise UsageError(f"the circuit holds {size} of {units.count} {units.level}: nothing to audit")
    info = {**run_info(ctx.cfg), "n": held.data.n, "intervention": "audit", "method": c.method, "audited": found.label}
    found_metric = held.per_prompt(units.to_mask(found.chosen))
    rows = [{**info, "metric": "size", "value": size}, {**info, "metric": "units", "value": units.count}]
    rows.append({**info, "metric": "faithfulness", "variant": "found", "value": held.share(found_metric)})
    with ctx.timed("stability"):
        variants = stability(audit, found)
    rows += variant_rows(info, variants)
    rescore = rescorer(audit, units)
    rival_scores = "cut" if rescore is None else c.rival_scores
    with ctx.timed("rivals"):
        found_rivals = rivals(units, found.scores, found.chosen, held, c.rivals, rescore, rival_scores != "rescored")
    rows += rival_rows(info, found_rivals, found_metric, held, c.n_boot, seed)
    with ctx.timed("tests"):
        tests, mini, tested = hypothesis_tests(audit, found, found_metric)
    if np.array_equal(found_metric, held.clean_per_prompt):
        ctx.note("the circuit scores as the model on every prompt: equivalence (a share of prompts) cannot tell")
    rows += test_rows(info, tests, mini, units, tested)
    shares = keep_shares([v.chosen for v in variants if v.kind in ("resample", "seed")] or [found.chosen])
    rows += keep_share_rows(info, units, found.chosen, shares)
    named = [("found", found.chosen), *((v.name, v.chosen) for v in variants)]
    rows += overlap_rows(info, named + [(f"rival_{r.round}", r.chosen) for r in found_rivals])
    ctx.meta.update(
        circuit=found.source,
        level=units.level,
        size=size,
        held_out_prompts=held.data.n,
        evaluations=audit.evaluations,
        tests={t.test: {"p_value": t.p_value, "rejected": t.rejected, "meaning": t.meaning} for t in tests},
        unique=unique(rows),
        rival_scores=rival_scores,
    )
    return results.conform(pd.DataFrame(rows))


def found_circuit(audit: Audit) -> Found:
    c = audit.c
    if c.heads:
        return heads_circuit(audit, [head_unit(str(h)) for h in c.heads], "heads given")
    if c.circuit and is_classes_run(Path(c.circuit)):
        return heads_circuit(audit, classed_heads(Path(c.circuit)), "heads of the IOI classes")
    units = Units(audit.graph, c.level)
    if c.circuit:
        edge_scores, mask, path = circuit_file(c.circuit, audit.graph)
        if not torch.nan_to_num(edge_scores).any():  # a circuit without scores: its rivals are cut from ours
            edge_scores = audit.score(c.method, audit.data)
        return Found(units, units.scores(edge_scores), units.of_mask(mask), str(path), f"{units.level} of {path.name}")
    edge_scores = audit.score(c.method, audit.data)
    scores = units.scores(edge_scores)
    how = f"{units.level} found by {c.method} at {c.target}"
    # found on the run's own prompts, where study=circuit finds its circuit
    return Found(units, scores, smallest(units, scores, audit.measure(audit.data), c.target), how, how, edge_scores)


def heads_circuit(audit: Audit, given: list[str], label: str) -> Found:
    units = Units(audit.graph, "heads")
    unknown = sorted(set(given) - set(units.names))
    if unknown:
        raise UsageError(f"study.heads: {', '.join(unknown)} not heads of this model")
    edge_scores = audit.score(audit.c.method, audit.data)
    chosen = torch.tensor([n in given for n in units.names])
    return Found(units, units.scores(edge_scores), chosen, "heads " + ",".join(given), label, edge_scores)


def smallest(units: Units, scores: Tensor, measure: Measure, target: float) -> Tensor:
    """The smallest circuit of the top k units reaching `target` where `measure` measures: the circuit
    study's search (edges/faithfulness.reaching over circuits of k units)."""
    chosen, _ = reaching(
        units.count, lambda k: units.top(scores, k), lambda c: measure.faithfulness(units.to_mask(c)), target
    )
    return chosen


def rescorer(audit: Audit, units: Units) -> Callable[[Tensor], Tensor] | None:
    """The rival search's scores with units forbidden (study.rival_scores both or rescored), where the method
    has them (edges/rescore.py); None: the found circuit's scores alone, cut."""
    c, method = audit.c, get_method(audit.c.method)
    if c.rival_scores == "cut":
        return None
    forbidding = method.forbidding
    if forbidding is None:
        audit.ctx.note(f"rivals cut from the found circuit's scores: {c.method} cannot score with units forbidden")
        return None

    def rescore(forbidden: Tensor) -> Tensor:
        edges = units.edges_of(forbidden)
        return units.scores(forbidding(audit.model, audit.task, audit.data, audit.graph, audit.budget, edges))

    return rescore


@dataclass
class Planned:
    """A variant to score: its name and kind, the prompts and method it is scored with, and the held-out
    prompts it is measured on (None: all)."""

    name: str
    kind: str
    prompts: TaskData
    method: str
    held_rows: np.ndarray | None = None


def planned(audit: Audit) -> list[Planned]:
    c, data, held = audit.c, audit.data, audit.held.data
    rng = np.random.default_rng(audit.ctx.cfg.seed)
    plan = [
        Planned(f"resample_{r + 1}", "resample", data.take(torch.as_tensor(rng.integers(0, data.n, data.n))), c.method)
        for r in range(c.resamples)
    ]
    plan += [Planned(f"draw_{s + 1}", "seed", audit.draw(s), c.method) for s in range(1, c.draws + 1)]
    if c.templates and data.groups is not None and held.groups is not None and len(data.groups.unique()) > 1:
        names = data.groups.unique().sort().values
        for half, (mine, theirs) in zip("ab", ((names[::2], names[1::2]), (names[1::2], names[::2]))):
            rows = torch.isin(data.groups, mine).nonzero().flatten()
            held_rows = torch.isin(held.groups, theirs).nonzero().flatten().numpy()
            if len(rows) and len(held_rows):
                plan.append(Planned(f"templates_{half}", "templates", data.take(rows), c.method, held_rows))
    for m in c.methods:
        if m == "exact" and audit.graph.n_edges > c.exact_limit:
            audit.ctx.note(f"exact patching left out of the methods: {audit.graph.n_edges} edges > study.exact_limit")
            continue
        plan.append(Planned(f"method_{m}", "method", data, m))
    if c.twice_the_steps and get_method(c.method).integrates:
        plan.append(Planned(f"steps_{2 * c.steps}", "steps", data, c.method))
    return plan


def stability(audit: Audit, found: Found) -> list[Variant]:
    c, ctx = audit.c, audit.ctx
    plan = planned(audit)
    base = found.edge_scores  # the method's own scores on the run's prompts, where it found the circuit
    variants: list[Variant] = []
    with progress_bar("audit: stability", total=len(plan), enabled=ctx.show_progress) as bar:
        for p in plan:
            started = time.perf_counter()
            if p.kind in ("method", "steps") and p.method == c.method and base is None:
                base = audit.score(c.method, audit.data)
            if p.kind == "steps":
                assert base is not None
                steps, ppp, first = c.steps, c.prompts_per_pass, c.ig_steps_from
                m, t, d, g = audit.model, audit.task, audit.data, audit.graph
                edge_scores = doubled_steps(m, t, d, g, c.method, base, steps, ppp, False, first)
            elif p.kind == "method" and p.method == c.method:
                assert base is not None
                edge_scores = base
            else:
                edge_scores = audit.score(p.method, p.prompts)
            variants.append(variant(audit, p, edge_scores, found))
            ctx.meta.setdefault("variant_seconds", {})[p.name] = round(time.perf_counter() - started, 1)
            bar.update(len(variants))
    return variants


def variant(audit: Audit, p: Planned, edge_scores: Tensor, found: Found) -> Variant:
    units, held = found.units, audit.held
    scores = units.scores(edge_scores)
    size = int(found.chosen.sum())
    chosen = units.top(scores, size)
    v = Variant(p.name, p.kind, chosen)
    v.jaccard = jaccard(chosen, found.chosen)
    v.jaccard_heads = jaccard(units.heads_of(chosen), units.heads_of(found.chosen))
    v.faithfulness = held.faithfulness(units.to_mask(chosen), p.held_rows)
    if audit.c.at_target:
        # searched as the found circuit was (a bisection from the whole graph), so equal scores find it again
        v.at_target = smallest(units, scores, audit.measure(p.prompts), audit.c.target)
        v.jaccard_at_target = jaccard(v.at_target, found.chosen)
        v.faithfulness_at_target = held.faithfulness(units.to_mask(v.at_target), p.held_rows)
    return v


def hypothesis_tests(
    audit: Audit, found: Found, found_metric: np.ndarray
) -> tuple[list[hypothesis.Outcome], hypothesis.Minimality, list[int]]:
    c, units, held, seed = audit.c, found.units, audit.held, audit.ctx.cfg.seed
    complement = held.per_prompt(units.to_mask(~found.chosen))
    inside = found.chosen.nonzero().flatten()
    weakest_first = inside[torch.argsort(found.scores[inside].abs(), stable=True)]
    tested = (weakest_first[: c.max_units] if c.max_units else weakest_first).tolist()
    knocked, added = [], []
    for u in tested:
        without = found.chosen.clone()
        without[u] = False
        knocked.append(held.per_prompt(units.to_mask(without)))
    for u in random_units(~found.chosen, c.n_random, seed):
        more = found.chosen.clone()
        more[u] = True
        added.append(held.per_prompt(units.to_mask(more)))
    mini = hypothesis.minimality(found_metric, np.stack(knocked), np.stack(added), c.quantile)
    tests = [
        hypothesis.equivalence(held.clean_per_prompt, found_metric, c.epsilon),
        hypothesis.independence(held.clean_per_prompt, complement, c.permutations, seed),
        mini.outcome,
    ]
    return tests, mini, tested


STUDY = Study(
    name="audit",
    description="is it the circuit? stability, disjoint rivals and Shi et al.'s hypothesis tests",
    run=run,
    summary=summary,
    reads=("train", "engine"),
    schema=AuditOptions,
    figures="audit",
)
