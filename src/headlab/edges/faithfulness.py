"""How faithful a circuit is, as MIB's circuit track measures it (Mueller et al. 2025).

faithfulness(C) = (m(C) - m(empty)) / (m(model) - m(empty)): the metric with only C's edges carrying
clean values (every other edge patched from the corrupted run), as a share of the clean-corrupted gap.
Over circuits of growing size (the top k% of edges, pruned), the curve's areas (trapezoids over the
fractions, divided by the largest) give CPR, the area under the curve with edges ranked by signed
score (higher is better; first the edges whose patching lowers the metric most, as MIB ranks by the
rise in a loss), and CMD, the area between the curve and 1 with edges ranked by absolute score
(lower is better).

Circuit sizes: the fractions are shares of the graph's edges counted as MIB and auto-circuit count them,
ungrouped (graph.py: under GQA one key/value edge of ours is one per query head sharing it), unless
`ungrouped=False`; each point records both counts. Intervals: CPR and CMD are recomputed on bootstrap
resamples of the prompts (the same resample for every circuit and for the clean and empty runs), the
edge scores and so the circuits held fixed: the spread of the evaluation over prompts, not of the
attribution. MIB reports neither interval nor the ungrouped/grouped distinction (its models are counted
ungrouped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..interventions.lengths import parts
from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .evaluate import Runs, circuit_metric, clean_and_corrupted
from .graph import EdgeGraph

FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes


@dataclass(frozen=True)
class Point:
    fraction: float
    n_edges: int  # after pruning
    faithfulness: float
    ranking: str  # signed | absolute
    n_edges_ungrouped: int  # the same circuit counted as the ungrouped graph's edges
    per_prompt: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))  # [n] the metric


@dataclass
class Faithfulness:
    clean: float
    corrupted: float
    points: list[Point]
    cpr: float
    cmd: float
    target: float
    target_edges: int  # the smallest top-n circuit (pruned) reaching the target, by absolute score
    target_faithfulness: float
    target_circuit: Tensor
    target_edges_ungrouped: int = 0
    ungrouped: bool = True  # whether the fractions count ungrouped edges
    cpr_ci: tuple[float, float] = (float("nan"), float("nan"))  # 95% bootstrap interval over prompts
    cmd_ci: tuple[float, float] = (float("nan"), float("nan"))


class Evaluator:
    """The faithfulness of circuits of one model on one task's prompts.

    `held`: the most prompts whose clean and corrupted recordings are kept at once (None: every prompt's,
    recorded once). With fewer, the prompts are measured a slice at a time and each slice's recordings are
    made again for each measurement (`per_prompt_many` makes them once for all its circuits): the same
    numbers, the curve's recordings a slice's memory (engine.max_memory sets it: planning.fitted_passes)."""

    def __init__(
        self,
        model: HookedModel,
        task: Task,
        data: TaskData,
        graph: EdgeGraph,
        selection: str = "top_n",
        held: int | None = None,
    ):
        self.model, self.task, self.data, self.graph, self.selection = model, task, data, graph, selection
        # prompts of like length together, each group through the positions it reads (lengths.parts)
        grouped = parts(data)
        self.sliced = held is not None and held < data.n  # recordings made again for each measurement
        if held is not None and self.sliced:
            grouped = [
                (rows[i : i + held], part.take(slice(i, i + held)))
                for rows, part in grouped
                for i in range(0, len(rows), held)
            ]
        self.parts = grouped
        self.runs: list[Runs | None] = [None] * len(grouped)
        if not self.sliced:
            self.runs = [clean_and_corrupted(model, graph, part) for _, part in grouped]
        self.clean_per_prompt, self.corrupted_per_prompt = self.per_prompt_many(
            [graph.real.clone(), torch.zeros_like(graph.real)]
        )
        self.clean = float(self.clean_per_prompt.mean())
        self.corrupted = float(self.corrupted_per_prompt.mean())

    def per_prompt(self, circuit: Tensor) -> np.ndarray:
        return self.per_prompt_many([circuit])[0]

    def per_prompt_many(self, circuits: list[Tensor]) -> list[np.ndarray]:
        """The metric [n] of each circuit; each slice of prompts recorded once for all of them."""
        out = [np.empty(self.data.n) for _ in circuits]
        for (rows, part), kept in zip(self.parts, self.runs):
            runs = kept if kept is not None else clean_and_corrupted(self.model, self.graph, part)
            for metric, circuit in zip(out, circuits):
                value = circuit_metric(self.model, self.task, part, self.graph, circuit, runs)
                metric[rows.numpy()] = value.double().cpu().numpy()
            del runs
        return out

    def circuit(self, scores: Tensor, n: int, absolute: bool, ungrouped: bool = False) -> Tensor:
        pick = self.graph.greedy if self.selection == "greedy" else self.graph.top_n
        return pick(torch.nan_to_num(scores), n, absolute=absolute, ungrouped=ungrouped)

    def share(self, metric: np.ndarray, rows: np.ndarray | None = None) -> float:
        """The metric [n] as a share of the clean-corrupted gap, over the prompts `rows` (None: all)."""
        if rows is None:
            clean, corrupted, mean = self.clean, self.corrupted, float(metric.mean())
        else:
            clean, corrupted = float(self.clean_per_prompt[rows].mean()), float(self.corrupted_per_prompt[rows].mean())
            mean = float(metric[rows].mean())
        gap = clean - corrupted
        return (mean - corrupted) / gap if gap else float("nan")

    def of(self, circuit: Tensor) -> float:
        return self.share(self.per_prompt(circuit))


def measure(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    scores: Tensor,
    fractions: tuple[float, ...] = FRACTIONS,
    target: float = 0.8,
    selection: str = "top_n",
    show_progress: bool = False,
    ungrouped: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    held: int | None = None,
) -> Faithfulness:
    ev = Evaluator(model, task, data, graph, selection, held)
    total = graph.total(ungrouped)
    # signed: the edges whose patching lowers the metric most come first (a score is the metric's change,
    # and the task's metric is higher where the task is done)
    wanted = [(ranking, f) for ranking in ("signed", "absolute") for f in fractions]
    circuits = [
        ev.circuit(scores if ranking == "absolute" else -scores, int(f * total), ranking == "absolute", ungrouped)
        for ranking, f in wanted
    ]
    points: list[Point] = []
    with progress_bar("faithfulness", total=len(circuits), enabled=show_progress) as bar:
        if ev.sliced:  # a slice of prompts recorded once for every circuit
            metrics = ev.per_prompt_many(circuits)
            bar.update(len(circuits))
        else:
            metrics = []
            for circuit in circuits:
                metrics.append(ev.per_prompt(circuit))
                bar.update(len(metrics))
    for (ranking, f), circuit, metric in zip(wanted, circuits, metrics):
        points.append(Point(f, graph.size(circuit), ev.share(metric), ranking, graph.size(circuit, True), metric))
    signed = [p for p in points if p.ranking == "signed"]
    absolute = [p for p in points if p.ranking == "absolute"]
    n, value, circuit = smallest(ev, scores, target)
    cpr_ci, cmd_ci = intervals(ev, signed, absolute, n_boot, seed)
    return Faithfulness(
        ev.clean,
        ev.corrupted,
        points,
        cpr=area([p.fraction for p in signed], [p.faithfulness for p in signed]),
        cmd=area([p.fraction for p in absolute], [abs(1 - p.faithfulness) for p in absolute]),
        target=target,
        target_edges=n,
        target_faithfulness=value,
        target_circuit=circuit,
        target_edges_ungrouped=graph.size(circuit, True),
        ungrouped=ungrouped,
        cpr_ci=cpr_ci,
        cmd_ci=cmd_ci,
    )


def intervals(
    ev: Evaluator, signed: list[Point], absolute: list[Point], n_boot: int, seed: int, level: float = 0.95
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Percentile bootstrap intervals of CPR and CMD over the prompts (one resample for every circuit)."""
    nan = (float("nan"), float("nan"))
    if not n_boot or not signed:
        return nan, nan
    n = len(ev.clean_per_prompt)
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    clean, corrupted = ev.clean_per_prompt[idx].mean(1), ev.corrupted_per_prompt[idx].mean(1)  # [n_boot]
    gap = np.where(clean != corrupted, clean - corrupted, np.nan)

    def curve(points: list[Point]) -> np.ndarray:  # [n_boot, fractions]
        return np.stack([(p.per_prompt[idx].mean(1) - corrupted) / gap for p in points], axis=1)

    fractions = [p.fraction for p in signed]
    cpr = np.array([area(fractions, list(row)) for row in curve(signed)])
    cmd = np.array([area([p.fraction for p in absolute], list(np.abs(1 - row))) for row in curve(absolute)])
    q = [50 * (1 - level), 50 * (1 + level)]

    def bounds(x: np.ndarray) -> tuple[float, float]:
        if not np.isfinite(x).any():
            return nan
        low, high = np.nanpercentile(x, q)
        return float(low), float(high)

    return bounds(cpr), bounds(cmd)


def area(x: list[float], y: list[float]) -> float:
    """Trapezoids under y(x), x divided by its largest value (MIB's area_under_curve)."""
    top = x[-1]
    return sum((x[i + 1] - x[i]) / top * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1))


def smallest(ev: Evaluator, scores: Tensor, target: float) -> tuple[int, float, Tensor]:
    """(edges, faithfulness, circuit) of the smallest circuit by absolute score whose faithfulness reaches
    `target`: `reaching` over circuits of k edges (EdgeGraph.top_pruned; greedy selection: EAP-IG's greedy
    circuit of k edges), the search study=audit makes too."""
    key = torch.nan_to_num(scores)
    if ev.selection == "greedy":
        of_size = lambda k: ev.graph.greedy(key, k, absolute=True)  # noqa: E731
    else:
        of_size = lambda k: ev.graph.top_pruned(key, k)  # noqa: E731
    circuit, value = reaching(ev.graph.n_edges, of_size, ev.of, target)
    return int(circuit.sum()), value, circuit


def reaching(
    size: int, of_size: Callable[[int], Tensor], value_of: Callable[[Tensor], float], target: float
) -> tuple[Tensor, float]:
    """(circuit, value) of the smallest k in 1..size whose circuit of_size(k) has value_of >= `target`, by
    bisection over k (the value taken as rising with k: where it does not, another crossing may be found;
    the whole, of_size(size), is taken to reach it with value 1 unmeasured)."""
    low, high = 0, size
    best, best_value = of_size(high), 1.0
    while high - low > 1:
        mid = (low + high) // 2
        circuit = of_size(mid)
        value = value_of(circuit)
        if value >= target:
            high, best, best_value = mid, circuit, value
        else:
            low = mid
    return best, best_value
