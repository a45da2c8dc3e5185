"""Intervention specs and the plan that a config expands to.

An intervention is one row of the result table. What it does to the model is a list of edits at one
layer, each on one site (z, pattern, q, k, v, mlp or neurons):
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
                                           receivers (interventions/path.py), at `token` or `position`
                                           (sender and receivers alike), else at every position
  calibrate_sink                           the head's pattern: each query's attention on the prompt's
                                           first token (method calibration_hidden: on the head's hidden
                                           sinks, by alpha = scale[1]) times scale[0], what it gives up
                                           shared among the other keys in proportion (edits.calibrated;
                                           every head of the layer if `head` is None)
  a user's own (`edit` set)                the head's site (every head if `head` is None) at `position`
                                           (or `token`, or every position) <- edit(that value); its
                                           name is free (interventions/user.py checks it at the door)
An ablation or patch edits z unless `site` names another head site (pattern, q, k, v); it edits every
position, or `position`, or per prompt the position of the role `token` (e.g. IOI's END).
Interventions at several layers act together through engine.execute_joint (circuit knockouts).
The names of sites, sources, kinds and methods are those of headlab.vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..config import Config, option
from ..errors import UsageError
from ..vocabulary import HEAD_SITES, SOURCE_OF_METHOD, Kind, Method, Site, Source, hook_name

if TYPE_CHECKING:
    from torch import Tensor

LOGITS = "logits"  # the receiver set of path patching that is the model's output itself
RECEIVER_SITES = (Site.q, Site.k, Site.v)  # path patching enters a receiver head by one of its inputs


@dataclass(frozen=True)
class Edit:
    site: Site
    heads: tuple[int, ...]  # head indices; for site neurons, MLP hidden-unit indices
    source: Source = Source.zero
    other_head: int | None = None
    scale: tuple[float, ...] = ()


@dataclass(frozen=True)
class Intervention:
    """One edit of a run: a built-in kind, or your own function of a site's values.

    Attributes:
        intervention: a built-in kind (`ablate_head`, `patch_head`, `path_patch`, `ablate_mlp`, ...), or the
            name your own edit goes by in the table.
        method: how a built-in kind replaces a value (zero, mean, resample, ...).
        layer: the layer edited.
        head: the head edited (None: every head of the layer).
        position: a token index (negative: from the end); None with no `token`: every position.
        token: a role whose position the task gives per prompt, e.g. IOI's END.
        site: z (default), pattern, q, k or v.
        edit: your own edit: the site's values where it touches them -> their replacement (same shape).

    Example:
        ```python
        headlab.Intervention("ablate_head", "mean", layer=0, head=1)
        headlab.Intervention("half", layer=0, head=1, position=5, edit=lambda z: 0.5 * z)
        ```
    """

    intervention: str  # a Kind
    method: str = Method.none  # a Method
    layer: int | None = None
    head: int | None = None
    position: int | None = None  # None: every position (unless token is set)
    token: str | None = None  # a role whose position the task gives per prompt, e.g. END
    site: str | None = None  # head site edited by ablate_head / patch_head (None: z)
    other_head: int | None = None
    receivers: str | None = None  # path_patch: "logits" or "layer.head ..."
    scale: tuple[float, ...] = ()
    neurons: tuple[int, ...] = ()  # ablate_neurons: MLP hidden units (not tabular; `group` names the set)
    group: str | None = None  # a label for the table, e.g. "recall_top8"
    # a user's own edit: the site's value where this intervention touches it -> its replacement (same shape)
    edit: Callable[[Tensor], Tensor] | None = None

    def edits(self, n_heads: int) -> list[Edit]:
        everyone = tuple(range(n_heads))
        others = tuple(h for h in everyone if h != self.head)
        kind = self.intervention
        if kind == Kind.none:
            return []
        if self.edit is not None:
            site = Site(self.site) if self.site else Site.z
            return [Edit(site, everyone if self.head is None else (self.head,), Source.function)]
        if kind in (Kind.ablate_head, Kind.patch_head, Kind.path_patch):
            site = Site(self.site) if kind != Kind.path_patch and self.site else Site.z
            return [Edit(site, everyone if self.head is None else (self.head,), SOURCE_OF_METHOD[self.method])]
        if kind == Kind.ablate_mlp:
            return [Edit(Site.mlp, (), SOURCE_OF_METHOD[self.method])]
        if kind == Kind.ablate_neurons:
            if not self.neurons:
                raise ValueError("ablate_neurons needs the neuron indices (neurons=(i, j, ...))")
            return [Edit(Site.neurons, tuple(self.neurons), SOURCE_OF_METHOD[self.method])]
        if kind == Kind.ablate_layer:
            return [Edit(Site.z, everyone, SOURCE_OF_METHOD[self.method])]
        if kind == Kind.keep_head:
            return [Edit(Site.z, others, SOURCE_OF_METHOD[self.method])]
        if kind in (Kind.pattern_from, Kind.values_from):
            site = Site.pattern if kind == Kind.pattern_from else Site.v
            swap = [Edit(site, (self.head,), Source.head, other_head=self.other_head)]  # type: ignore[arg-type]
            ablate = [Edit(Site.z, others, SOURCE_OF_METHOD[self.method])] if self.method in SOURCE_OF_METHOD else []
            return swap + ablate
        if kind == Kind.scale_heads:
            return [Edit(Site.z, everyone, Source.scale, scale=self.scale)]
        if kind == Kind.calibrate_sink:
            hidden = self.method == Method.calibration_hidden
            if not (len(self.scale) in (2, 3) if hidden else len(self.scale) == 1):
                raise ValueError(f"calibrate_sink needs scale=(factor{', alpha[, fixed]' if hidden else ''})")
            heads = everyone if self.head is None else (self.head,)
            source = Source.calibrate_hidden if hidden else Source.calibrate
            return [Edit(Site.pattern, heads, source, scale=self.scale)]
        raise ValueError(f"unknown intervention '{kind}'")

    @property
    def hook(self) -> str | None:
        """TransformerLens's name of the hook its edits land on (the table's `hook`), None where they land
        on none (the clean run) or on two (a swap with the other heads ablated)."""
        # the sites and not the heads decide, so any head count lists them; path patching edits the
        # sender's z, whatever receiver site it is entered by
        sites = {edit.site for edit in self.edits(1)}
        return hook_name(sites.pop(), self.layer) if len(sites) == 1 else None

    def row(self) -> dict[str, Any]:
        """The table's columns for this intervention (the scale and neuron vectors and a user's edit
        function are not tabular), with its hook."""
        skip = ("scale", "neurons", "edit")
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}, "hook": self.hook}


CLEAN = Intervention(Kind.none)


def plan(
    cfg: Config,
    n_layers: int,
    n_heads: int,
    scales: dict[int, list[float]] | None = None,
    scales_at: dict[str, dict[int, list[float]]] | None = None,
) -> list[Intervention]:
    """The clean baseline first, then the ablation sweep, then the patching sweep.

    `scales` (layer -> per-head factors, applied at every position) is needed by the uniform sweep only;
    `scales_at` (role -> layer -> factors) adds one uniform row per role, scaled at that role only."""
    out = [CLEAN]
    sweep, method = option(cfg.ablate.sweep), option(cfg.ablate.method)
    cells = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    if sweep == "heads":
        out += [Intervention(Kind.ablate_head, method, l, h) for l, h in cells]
    elif sweep == "layers":
        out += [Intervention(Kind.ablate_layer, method, l) for l in range(n_layers)]
    elif sweep == "keep_heads":
        out += [Intervention(Kind.keep_head, method, l, h) for l, h in cells]
    elif sweep in ("pattern_swaps", "value_swaps"):
        kind = Kind.pattern_from if sweep == "pattern_swaps" else Kind.values_from
        out += [Intervention(Kind.keep_head, method, l, h) for l, h in cells]
        out += [Intervention(kind, method, l, h, other_head=o) for l, h in cells for o in range(n_heads) if o != h]
    elif sweep == "uniform":
        if scales is None:
            raise ValueError("the uniform sweep needs per-head scales")
        out += [Intervention(Kind.scale_heads, Method.uniform, l, scale=tuple(scales[l])) for l in range(n_layers)]
        for role, at in (scales_at or {}).items():
            out += [
                Intervention(Kind.scale_heads, Method.uniform, l, token=role, scale=tuple(at[l]))
                for l in range(n_layers)
            ]
    elif sweep == "components":
        out += [Intervention(Kind.ablate_head, method, l, h) for l, h in cells]
        out += [Intervention(kind, method, l) for l in range(n_layers) for kind in (Kind.ablate_layer, Kind.ablate_mlp)]
    elif sweep == "sink_calibration":
        factor = float(cfg.ablate.calibration)  # in [0, 1], as config_rules checks at the door
        hidden = option(cfg.ablate.sinks) == "hidden"
        label = f"calibration {factor:g}"  # the factor in the table, where the vector `scale` is not
        method, scale = (
            (Method.calibration_hidden, (factor, cfg.ablate.sink_alpha, cfg.ablate.sink_threshold))
            if hidden
            else (Method.calibration, (factor,))
        )
        out += [Intervention(Kind.calibrate_sink, method, l, h, scale=scale, group=label) for l, h in cells]
    kinds = [option(k) for k in cfg.patch.kinds]
    for patching in (Method.activation, Method.attribution):
        if patching in kinds:
            out += [
                Intervention(Kind.patch_head, patching, l, h, site=site, **where)
                for site in _sites(cfg.patch.sites)
                for where in _positions(cfg.patch.positions)
                for l, h in cells
            ]
    if Method.path in kinds:
        receivers, site = _receivers(cfg.patch.receivers, cfg.patch.receiver_site, n_layers, n_heads)
        out += [
            Intervention(Kind.path_patch, Method.path, l, h, site=site, receivers=receivers, **where)
            for where in _positions(cfg.patch.positions)
            for l, h in cells
        ]
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


def _receivers(receivers: Any, site: str, n_layers: int, n_heads: int) -> tuple[str, str | None]:
    """The receiver set as the table spells it ("logits" or "9.6 9.9"), and the site it is entered by."""
    names = [str(r) for r in receivers]
    if names == [LOGITS]:
        return LOGITS, None
    if site not in RECEIVER_SITES:
        raise UsageError(f"path patching enters receiver heads by q, k or v, not '{site}'")
    for r in names:
        layer, _, head = r.partition(".")
        if not (layer.isdigit() and head.isdigit() and int(layer) < n_layers and int(head) < n_heads):
            raise UsageError(f"receiver '{r}' is not 'logits' or a head 'layer.head' of this model")
    return " ".join(names), site


def receiver_heads(receivers: str) -> dict[int, list[int]]:
    """layer -> heads of a path-patching receiver set ("logits" -> {})."""
    out: dict[int, list[int]] = {}
    if receivers != LOGITS:
        for r in receivers.split():
            layer, head = map(int, r.split("."))
            out.setdefault(layer, []).append(head)
    return out
