"""Is a circuit *the* circuit? Its units, its overlap with the circuits other choices find, and its rivals.

A circuit is a set of units of the edge graph: its edges, or its heads (a head out of the circuit has
every outgoing edge patched from the corrupted run; inputs and MLPs stay). Every circuit here is evaluated
by evaluate.py's circuit metric, exactly, on held-out prompts.

- Stability: a variant (another prompt draw, a bootstrap resample of the prompts, half of the templates,
  another method or twice the steps) scores the units again; its circuit is its top units at the found
  circuit's size; the overlap with the found circuit is the Jaccard index of their units.
- Rivals (`rivals`): the found circuit's units forbidden, the best circuit of the same size from the rest,
  by the found circuit's scores (cut) and by the units' scores again in the model whose forbidden units
  carry the corrupted run's values (rescored: edges/rescore.py), each measured, the more faithful kept;
  then its units forbidden too, and so on (neither search finds the stronger rival every time). The
  margin is the found circuit's faithfulness less the best rival's, with a paired bootstrap interval over
  prompts: the found circuit is unique at its size where that interval lies above zero.

A unit's score for heads is the sum of its outgoing edges' scores (what an attribution method's node score
is: edges/methods.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from .faithfulness import Evaluator
from .graph import EdgeGraph

LEVELS = ("edges", "heads")


@dataclass(frozen=True)
class Units:
    """The units a circuit is made of, in a fixed order: the graph's edges (row-major over [senders,
    receivers]) or its heads (sender order)."""

    graph: EdgeGraph
    level: str  # LEVELS

    @cached_property
    def index(self) -> Tensor:
        """Edges: flat indices into [senders, receivers]; heads: sender rows."""
        if self.level == "edges":
            return self.graph.real.flatten().nonzero().flatten()
        return torch.tensor([i for i, s in enumerate(self.graph.senders) if s.kind == "head"])

    @property
    def count(self) -> int:
        return len(self.index)

    @cached_property
    def names(self) -> list[str]:
        if self.level == "edges":
            return self.graph.edge_names()
        return [self.graph.senders[i].name for i in self.index.tolist()]

    def scores(self, edge_scores: Tensor) -> Tensor:
        """[units] float64 from [senders, receivers] edge scores (NaN read as 0)."""
        s = torch.nan_to_num(edge_scores.double()) * self.graph.real
        return s.flatten()[self.index] if self.level == "edges" else s.sum(1)[self.index]

    def of_mask(self, mask: Tensor) -> Tensor:
        """[units] bool: the units of an edge circuit (heads: those with an edge in it)."""
        mask = mask & self.graph.real
        return mask.flatten()[self.index] if self.level == "edges" else mask.any(1)[self.index]

    def to_mask(self, chosen: Tensor) -> Tensor:
        """The edge circuit [senders, receivers] of the units `chosen` [units] bool."""
        if self.level == "edges":
            mask = torch.zeros_like(self.graph.real)
            mask.view(-1)[self.index[chosen]] = True
            return mask
        cut = torch.zeros(len(self.graph.senders), dtype=torch.bool)
        cut[self.index[~chosen]] = True
        return self.graph.real & ~cut[:, None]

    def top(self, scores: Tensor, k: int, forbidden: Tensor | None = None) -> Tensor:
        """[units] bool: the k units of highest |score|, none of `forbidden`. Edges: EdgeGraph.top_pruned's
        circuit of k edges (pruned as the circuit study prunes its circuits), so circuits of one size
        compare."""
        if self.level == "edges":
            full = torch.zeros(self.graph.real.shape, dtype=torch.float64)
            full.view(-1)[self.index] = scores.double()
            allowed = None if forbidden is None else self.to_mask(~forbidden)
            return self.of_mask(self.graph.top_pruned(full, k, allowed))
        key = scores.abs().double()
        allowed_units = torch.ones(self.count, dtype=torch.bool) if forbidden is None else ~forbidden
        order = torch.argsort(key, descending=True, stable=True)
        chosen = torch.zeros(self.count, dtype=torch.bool)
        chosen[order[allowed_units[order]][:k]] = True
        return chosen

    def edges_of(self, chosen: Tensor) -> Tensor:
        """[senders, receivers] bool: the edges the units `chosen` hold (heads: every edge out of them)."""
        return self.graph.real & ~self.to_mask(~chosen)

    def heads_of(self, chosen: Tensor) -> Tensor:
        """[heads] bool: the heads a circuit of these units touches."""
        return Units(self.graph, "heads").of_mask(self.to_mask(chosen))


def jaccard(a: Tensor, b: Tensor) -> float:
    union = int((a | b).sum())
    return int((a & b).sum()) / union if union else 1.0


@dataclass
class Variant:
    """One other way of finding the circuit, scored and cut at the found circuit's size."""

    name: str
    kind: str  # resample | seed | templates | method | steps
    chosen: Tensor  # [units] bool
    faithfulness: float = float("nan")  # on the held-out prompts
    jaccard: float = float("nan")  # with the found circuit's units
    jaccard_heads: float = float("nan")
    at_target: Tensor | None = None  # [units] bool: its own smallest circuit reaching the target, where asked
    jaccard_at_target: float = float("nan")  # with the found circuit's units
    faithfulness_at_target: float = float("nan")  # on the held-out prompts


@dataclass
class Rival:
    round: int
    chosen: Tensor  # [units] bool
    faithfulness: float
    shared_units: int  # with the found circuit
    jaccard_heads: float
    per_prompt: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    scores: str = "cut"  # the scores it was built from: cut (the found circuit's) or rescored


def rivals(
    units: Units,
    scores: Tensor,
    found: Tensor,
    ev: Evaluator,
    rounds: int,
    rescore: Callable[[Tensor], Tensor] | None = None,
    cut: bool = True,
) -> list[Rival]:
    """Disjoint circuits of the found one's size (in units before pruning), each the more faithful of the
    best of the units no earlier circuit holds by `scores` (where `cut`) and by `rescore(forbidden)` ([units]
    scores with the units `forbidden` [units] bool held at their corrupted values, where given)."""
    size, forbidden, out = int(found.sum()), found.clone(), []
    found_heads = units.heads_of(found)
    for r in range(1, rounds + 1):
        if int((~forbidden).sum()) == 0:
            break
        built = [("cut", units.top(scores, size, forbidden))] if cut or rescore is None else []
        if rescore is not None:
            again = units.top(rescore(forbidden), size, forbidden)
            if not built or not torch.equal(again, built[0][1]):
                built.append(("rescored", again))
        measured = [(how, chosen, ev.per_prompt(units.to_mask(chosen))) for how, chosen in built if chosen.any()]
        if not measured:
            break
        how, chosen, metric = max(measured, key=lambda m: ev.share(m[2]))
        shared, heads = int((chosen & found).sum()), jaccard(units.heads_of(chosen), found_heads)
        out.append(Rival(r, chosen, ev.share(metric), shared, heads, metric, how))
        forbidden |= chosen
    return out


def margin(
    found: np.ndarray, rival: np.ndarray, ev: Evaluator, n_boot: int, seed: int, level: float = 0.95
) -> tuple[float, float, float]:
    """The found circuit's faithfulness less the rival's, and its percentile bootstrap interval over the
    prompts (the same resample for both circuits and the clean and corrupted runs)."""
    value = ev.share(found) - ev.share(rival)
    if not n_boot:
        return value, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    n = len(found)
    draws = [ev.share(found, rows) - ev.share(rival, rows) for rows in rng.integers(0, n, size=(n_boot, n))]
    low, high = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return value, float(low), float(high)


def keep_shares(chosen: list[Tensor]) -> Tensor:
    """[units] float: the share of the circuits `chosen` that hold each unit."""
    return torch.stack(chosen).double().mean(0)


def interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of values over variants of one kind (resamples, seeds)."""
    if len(values) < 2:
        return float("nan"), float("nan")
    low, high = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def random_units(outside: Tensor, n: int, seed: int) -> list[int]:
    """n units drawn (with replacement) from those `outside` [units] bool marks."""
    pool = outside.nonzero().flatten().tolist()
    rng = np.random.default_rng(seed)
    return [pool[i] for i in rng.integers(0, len(pool), size=n)] if pool else []
