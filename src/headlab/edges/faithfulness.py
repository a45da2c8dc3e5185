"""How faithful a circuit is, as MIB's circuit track measures it (Mueller et al. 2025).

faithfulness(C) = (m(C) - m(empty)) / (m(model) - m(empty)): the metric with only C's edges carrying
clean values (every other edge patched from the corrupted run), as a share of the clean-corrupted gap.
Over circuits of growing size (the top k% of edges, pruned), the curve's areas (trapezoids over the
fractions, divided by the largest) give CPR, the area under the curve with edges ranked by signed
score (higher is better; first the edges whose patching lowers the metric most, as MIB ranks by the
rise in a loss), and CMD, the area between the curve and 1 with edges ranked by absolute score
(lower is better).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .exact import circuit_metric, clean_and_corrupted
from .graph import EdgeGraph

FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's circuit sizes


@dataclass(frozen=True)
class Point:
    fraction: float
    n_edges: int  # after pruning
    faithfulness: float
    ranking: str  # signed | absolute


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


class Evaluator:
    """The faithfulness of circuits of one model on one task's prompts."""

    def __init__(self, model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, selection: str = "top_n"):
        self.model, self.task, self.data, self.graph, self.selection = model, task, data, graph, selection
        self.runs = clean_and_corrupted(model, graph, data)
        self.clean = self._mean(graph.real.clone())
        self.corrupted = self._mean(torch.zeros_like(graph.real))

    def _mean(self, circuit: Tensor) -> float:
        return float(circuit_metric(self.model, self.task, self.data, self.graph, circuit, self.runs).double().mean())

    def circuit(self, scores: Tensor, n: int, absolute: bool) -> Tensor:
        pick = self.graph.greedy if self.selection == "greedy" else self.graph.top_n
        return pick(torch.nan_to_num(scores), n, absolute=absolute)

    def of(self, circuit: Tensor) -> float:
        gap = self.clean - self.corrupted
        return (self._mean(circuit) - self.corrupted) / gap if gap else float("nan")


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
) -> Faithfulness:
    ev = Evaluator(model, task, data, graph, selection)
    points: list[Point] = []
    with progress_bar("faithfulness", total=2 * len(fractions), enabled=show_progress) as bar:
        for ranking in ("signed", "absolute"):
            for f in fractions:
                # signed: the edges whose patching lowers the metric most come first (a score is the
                # metric's change, and the task's metric is higher where the task is done)
                key = scores if ranking == "absolute" else -scores
                circuit = ev.circuit(key, int(f * graph.n_edges), absolute=ranking == "absolute")
                points.append(Point(f, int(circuit.sum()), ev.of(circuit), ranking))
                bar.update(len(points))
    signed = [p for p in points if p.ranking == "signed"]
    absolute = [p for p in points if p.ranking == "absolute"]
    n, value, circuit = smallest(ev, scores, target)
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
    )


def area(x: list[float], y: list[float]) -> float:
    """Trapezoids under y(x), x divided by its largest value (MIB's area_under_curve)."""
    top = x[-1]
    return sum((x[i + 1] - x[i]) / top * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1))


def smallest(ev: Evaluator, scores: Tensor, target: float) -> tuple[int, float, Tensor]:
    """(edges, faithfulness, circuit) of the smallest top-n circuit by absolute score whose
    faithfulness reaches `target`, by bisection over n (faithfulness taken as rising with n; the whole
    graph, faithfulness 1, always qualifies)."""
    low, high = 0, ev.graph.n_edges
    best = ev.circuit(scores, high, absolute=True)
    best_value = 1.0
    while high - low > 1:
        mid = (low + high) // 2
        circuit = ev.circuit(scores, mid, absolute=True)
        value = ev.of(circuit)
        if value >= target:
            high, best, best_value = mid, circuit, value
        else:
            low = mid
    return int(best.sum()), best_value, best
