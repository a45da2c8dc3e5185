"""Intervention specs and the plan that a config expands to.

An intervention is one row of the result table. What it does to the model is a list of edits at one
layer, each on one head site (z, pattern or v):
  ablate_head / ablate_layer / keep_head   z of the named heads <- zero | mean | resample value
  patch_head                               z of the head <- its value in the counterfactual run
  pattern_from / values_from               head's pattern (values) <- other_head's, in the same run;
                                           with method zero|mean the other heads are ablated as well
                                           (the head alone, carrying another head's pattern or values)
  scale_heads                              z of every head multiplied by its factor in `scale`
  ablate_mlp                               the layer's MLP output <- zero | mean | resample value
  ablate_neurons                           the MLP hidden units `neurons` <- zero | mean | resample value
                                           (`group` labels the set in the table, e.g. recall_top8)
  path_patch                               the head's z <- its reference-run value, seen only by the
                                           receivers (interventions/path.py)
An ablation or patch edits z unless `site` names another head site (pattern, q, k, v); it edits every
position, or `position`, or per prompt the position of the role `token` (e.g. IOI's END).
Interventions at several layers act together through engine.execute_joint (circuit knockouts).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ..config import option
from ..errors import UsageError

SOURCES = {"zero": "zero", "mean": "mean", "resample": "reference", "activation": "counterfactual",
           "attribution": "counterfactual", "path": "reference"}  # fmt: skip
HEAD_SITES = ("z", "pattern", "q", "k", "v")


@dataclass(frozen=True)
class Edit:
    site: str  # z | pattern | q | k | v | mlp | neurons
    heads: tuple[int, ...]  # head indices; for site "neurons", MLP hidden-unit indices
    source: str = "zero"  # zero | mean | reference | counterfactual | head | scale
    other_head: Optional[int] = None
    scale: tuple[float, ...] = ()


@dataclass(frozen=True)
class Intervention:
    intervention: str  # none | ablate_head | ablate_layer | keep_head | patch_head | pattern_from | ...
    method: str = "none"  # none | zero | mean | resample | activation | swap | scale
    layer: Optional[int] = None
    head: Optional[int] = None
    position: Optional[int] = None  # None: every position (unless token is set)
    token: Optional[str] = None  # a role whose position the task gives per prompt, e.g. END
    site: Optional[str] = None  # head site edited by ablate_head / patch_head (None: z)
    other_head: Optional[int] = None
    receivers: Optional[str] = None  # path_patch: "logits" or "layer.head ..."
    scale: tuple[float, ...] = ()
    neurons: tuple[int, ...] = ()  # ablate_neurons: MLP hidden units (not tabular; `group` names the set)
    group: Optional[str] = None  # a label for the table, e.g. "recall_top8"

    def edits(self, n_heads: int) -> list[Edit]:
        everyone = tuple(range(n_heads))
        others = tuple(h for h in everyone if h != self.head)
        kind = self.intervention
        if kind == "none":
            return []
        if kind in ("ablate_head", "patch_head", "path_patch"):
            site = self.site if kind != "path_patch" and self.site else "z"
            return [Edit(site, everyone if self.head is None else (self.head,), SOURCES[self.method])]
        if kind == "ablate_mlp":
            return [Edit("mlp", (), SOURCES[self.method])]
        if kind == "ablate_neurons":
            if not self.neurons:
                raise ValueError("ablate_neurons needs the neuron indices (neurons=(i, j, ...))")
            return [Edit("neurons", tuple(self.neurons), SOURCES[self.method])]
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
        """The table's columns for this intervention (the scale and neuron vectors are not tabular)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("scale", "neurons")}


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
    elif sweep == "components":
        out += [Intervention("ablate_head", method, l, h) for l, h in cells]
        out += [Intervention(kind, method, l) for l in range(n_layers) for kind in ("ablate_layer", "ablate_mlp")]
    kinds = [option(k) for k in cfg.patch.kinds]
    for kind in ("activation", "attribution"):
        if kind in kinds:
            out += [Intervention("patch_head", kind, l, h, site=site, **where)
                    for site in _sites(cfg.patch.sites) for where in _positions(cfg.patch.positions)
                    for l, h in cells]  # fmt: skip
    if "path" in kinds:
        receivers, site = _receivers(cfg.patch.receivers, cfg.patch.receiver_site, n_layers, n_heads)
        out += [Intervention("path_patch", "path", l, h, site=site, receivers=receivers) for l, h in cells]
    return out


def _sites(sites: Any) -> list[str]:
    for s in sites:
        if s not in HEAD_SITES:
            raise UsageError(f"unknown head site '{s}'; choose from: {', '.join(HEAD_SITES)}")
    return list(sites)


def _positions(positions: Any) -> list[dict[str, Any]]:
    """'all' -> every position; an integer -> that index; any other word -> a role the task names."""
    out: list[dict[str, Any]] = []
    for p in positions:
        p = str(p)
        out.append({} if p == "all" else {"position": int(p)} if p.lstrip("-").isdigit() else {"token": p})
    return out


def _receivers(receivers: Any, site: str, n_layers: int, n_heads: int) -> tuple[str, Optional[str]]:
    """The receiver set as the table spells it ("logits" or "9.6 9.9"), and the site it is entered by."""
    names = [str(r) for r in receivers]
    if names == ["logits"]:
        return "logits", None
    if site not in ("q", "k", "v"):
        raise UsageError(f"path patching enters receiver heads by q, k or v, not '{site}'")
    for r in names:
        layer, _, head = r.partition(".")
        if not (layer.isdigit() and head.isdigit() and int(layer) < n_layers and int(head) < n_heads):
            raise UsageError(f"receiver '{r}' is not 'logits' or a head 'layer.head' of this model")
    return " ".join(names), site


def receiver_heads(receivers: str) -> dict[int, list[int]]:
    """layer -> heads of a path-patching receiver set ("logits" -> {})."""
    out: dict[int, list[int]] = {}
    if receivers != "logits":
        for r in receivers.split():
            layer, head = map(int, r.split("."))
            out.setdefault(layer, []).append(head)
    return out
