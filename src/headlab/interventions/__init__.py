"""Intervention specs and the plan that a config expands to.

An intervention is one row of the result table. What it does to the model is a list of edits at one
layer, each on one head site (z, pattern or v):
  ablate_head / ablate_layer / keep_head   z of the named heads <- zero | mean | resample value
  patch_head                               z of the head <- its value in the counterfactual run
  pattern_from / values_from               head's pattern (values) <- other_head's, in the same run;
                                           with method zero|mean the other heads are ablated as well
                                           (the head alone, carrying another head's pattern or values)
  scale_heads                              z of every head multiplied by its factor in `scale`
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ..config import option

SOURCES = {"zero": "zero", "mean": "mean", "resample": "reference", "activation": "counterfactual"}


@dataclass(frozen=True)
class Edit:
    site: str  # z | pattern | v
    heads: tuple[int, ...]
    source: str = "zero"  # zero | mean | reference | counterfactual | head | scale
    other_head: Optional[int] = None
    scale: tuple[float, ...] = ()


@dataclass(frozen=True)
class Intervention:
    intervention: str  # none | ablate_head | ablate_layer | keep_head | patch_head | pattern_from | ...
    method: str = "none"  # none | zero | mean | resample | activation | swap | scale
    layer: Optional[int] = None
    head: Optional[int] = None
    position: Optional[int] = None  # None: every position
    other_head: Optional[int] = None
    scale: tuple[float, ...] = ()

    def edits(self, n_heads: int) -> list[Edit]:
        everyone = tuple(range(n_heads))
        others = tuple(h for h in everyone if h != self.head)
        kind = self.intervention
        if kind == "none":
            return []
        if kind in ("ablate_head", "patch_head"):
            return [Edit("z", everyone if self.head is None else (self.head,), SOURCES[self.method])]
        if kind == "ablate_layer":
            return [Edit("z", everyone, SOURCES[self.method])]
        if kind == "keep_head":
            return [Edit("z", others, SOURCES[self.method])]
        if kind in ("pattern_from", "values_from"):
            site = "pattern" if kind == "pattern_from" else "v"
            swap = [Edit(site, (self.head,), "head", other_head=self.other_head)]
            return swap + ([Edit("z", others, SOURCES[self.method])] if self.method in SOURCES else [])
        if kind == "scale_heads":
            return [Edit("z", everyone, "scale", scale=self.scale)]
        raise ValueError(f"unknown intervention '{kind}'")

    def row(self) -> dict[str, Any]:
        """The table's columns for this intervention (the scale vector is not tabular)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scale"}


CLEAN = Intervention("none")


def plan(cfg: Any, n_layers: int, n_heads: int, scales: Optional[dict[int, list[float]]] = None) -> list[Intervention]:
    """The clean baseline first, then the ablation sweep, then the patching sweep.

    `scales` (layer -> per-head factors) is needed by the uniform sweep only."""
    out = [CLEAN]
    sweep, method = option(cfg.ablate.sweep), option(cfg.ablate.method)
    cells = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    if sweep == "heads":
        out += [Intervention("ablate_head", method, l, h) for l, h in cells]
    elif sweep == "layers":
        out += [Intervention("ablate_layer", method, l) for l in range(n_layers)]
    elif sweep == "keep_heads":
        out += [Intervention("keep_head", method, l, h) for l, h in cells]
    elif sweep in ("pattern_swaps", "value_swaps"):
        kind = "pattern_from" if sweep == "pattern_swaps" else "values_from"
        out += [Intervention("keep_head", method, l, h) for l, h in cells]
        out += [Intervention(kind, method, l, h, other_head=o) for l, h in cells for o in range(n_heads) if o != h]
    elif sweep == "uniform":
        if scales is None:
            raise ValueError("the uniform sweep needs per-head scales")
        out += [Intervention("scale_heads", "uniform", l, scale=tuple(scales[l])) for l in range(n_layers)]
    if option(cfg.patch.kind) == "activation":
        out += [Intervention("patch_head", "activation", l, h) for l, h in cells]
    return out
