"""What an edit does to a site: replacement values, indexing, and hooks over stacked copies.

The engine, path patching and attribution patching all run a batch that stacks g copies of the prompts
([g*n, ...]), copy i edited as its interventions say. This module holds what they share:
  Sources           replacement values per (source, site, layer), recorded once per sweep (`subset`: for
                    some of the prompts, cut to their length)
  position_axis     the positions' dimension in a site's layout
  site_index        the index of (prompts, positions, heads) in a site's layout
  edit_heads        the heads an edit touches on a site (k and v: key/value heads)
  apply_edit        one edit on one copy, in place
  calibrated        a pattern with its sinks' attention calibrated (sink calibration)
  edit_hooks        per-site hooks that edit copy i of a stacked batch as chunk[i] says
  copy_edit_hooks   the same with several interventions per copy
  copy_bytes        the memory one stacked copy needs at once in a block
  chunk_size        how many copies fit in a memory budget
  edits_pattern     whether interventions edit an attention pattern (the attention then runs eagerly)
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import cached_property

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from ..config import option
from ..errors import UsageError
from ..models.hooked import HookedModel
from ..models.sites import Hook, attention_bytes, runs_eagerly
from ..tasks import Inputs, TaskData
from ..vocabulary import KV_SITES, MLP_SITES, Site, Source
from .options import MeanOver
from .plan import Edit, Intervention
from .sinks import hidden_sinks, real_tokens
from .user import edited

Place = int | Tensor | None  # where an intervention edits: every position | one index | one per prompt [n]
Position = Place | slice  # an index into a site's positions: also a range (a suffix run's)
# sources that need no recorded value: the edit makes its replacement from the edited run itself
UNRECORDED = (Source.zero, Source.head, Source.scale, Source.calibrate, Source.calibrate_hidden, Source.function)


class Sources:
    """Replacement values per (source, site, layer), recorded once per sweep and only when needed.

    A value is stored with as few rows as it needs (the reference set once, one mean per group) and
    `rows[source]` ([n]) says which stored row stands in for each prompt.

    Mean ablation's mean (`mean_over`): "positions", one mean per position over the reference prompts
    that have a real token there (an `attention_mask` in the reference inputs says which; padding never
    counts); "tokens", one mean per head (per site) over every real token of every reference prompt, the
    same at every position. Either is taken per group where the task groups its prompts."""

    def __init__(
        self,
        model: HookedModel,
        data: TaskData,
        needed: Iterable[tuple[str, str]],
        seed: int = 0,
        mean_over: str = MeanOver.positions.value,
    ) -> None:
        if option(mean_over) not in {m.value for m in MeanOver}:
            raise UsageError(f"unknown mean_over '{mean_over}'; choose from: {', '.join(m.value for m in MeanOver)}")
        self._of_prompts(data, model.n_heads)
        self.mean_over = MeanOver(option(mean_over))
        self.kv_head_of = model.sites.kv_head_of
        wanted = {(src, site) for src, site in needed if src not in UNRECORDED}
        if any(src in (Source.mean, Source.reference) for src, _ in wanted) and data.reference is None:
            raise UsageError("this task provides no reference set for mean/resample ablation")
        if any(src == Source.counterfactual for src, _ in wanted) and data.counterfactual is None:
            raise UsageError("this task provides no counterfactual prompts for patching")
        if data.reference is not None:
            n_ref = next(iter(data.reference.values())).shape[0]
            if data.reference_rows is not None:  # the task paired each prompt with a reference prompt
                self.rows[Source.reference] = data.reference_rows.cpu()
            elif n_ref == data.n:
                self.rows[Source.reference] = torch.arange(data.n)  # the task matched reference i to prompt i
            else:
                self.rows[Source.reference] = torch.from_numpy(np.random.default_rng(seed).integers(0, n_ref, data.n))
            if data.groups is not None and data.reference_groups is not None:
                self.rows[Source.mean] = data.groups.cpu()
            else:
                self.rows[Source.mean] = torch.zeros(data.n, dtype=torch.long)
        inputs: dict[str, Inputs | None] = {
            Source.clean: data.inputs,
            Source.counterfactual: data.counterfactual,
            Source.reference: data.reference,
        }
        for src, site in sorted(wanted):
            if src == Source.mean:
                continue
            # a wanted source's prompts exist: checked above
            self.values[(src, site)] = model.record(inputs[src], site)  # type: ignore[arg-type]
        for _, site in sorted(w for w in wanted if w[0] == Source.mean):
            recorded = self.values.get((Source.reference, site)) or model.record(data.reference, site)  # type: ignore[arg-type]
            self.values[(Source.mean, site)] = {layer: self._means(t, site) for layer, t in recorded.items()}

    def _of_prompts(self, data: TaskData, n_heads: int) -> None:
        self.data, self.n_heads = data, n_heads
        self.values: dict[tuple[str, str], dict[int, Tensor]] = {}
        # what would otherwise cross between host and device once per edit (on a GPU each crossing waits
        # for the queue to drain): the rows on each values' device, each role's first position
        self._rows_on: dict[tuple[str, torch.device], Tensor] = {}
        self._earliest: dict[str, int] = {}
        self.rows: dict[str, Tensor] = {Source.counterfactual: torch.arange(data.n), Source.clean: torch.arange(data.n)}

    @classmethod
    def of_prompts(cls, data: TaskData, n_heads: int) -> Sources:
        """What the prompts alone tell, no model and no values recorded: where each intervention first edits
        (first_edited), as the plan asks before any model exists (flops.sweep_gflop)."""
        sources = cls.__new__(cls)
        sources._of_prompts(data, n_heads)
        return sources

    def _means(self, t: Tensor, site: str) -> Tensor:
        """[groups, ...]: the mean over the reference prompts of each group (one group if none), per
        position or over every real token as `mean_over` says."""
        mask = (self.data.reference or {}).get("attention_mask")
        if self.mean_over == MeanOver.positions and mask is None:  # every reference prompt counts everywhere
            if self.data.groups is None or self.data.reference_groups is None:
                return t.mean(0, keepdim=True)
            counts = _group_sums(t.new_ones(t.shape[0], *([1] * (t.dim() - 1))), self.data)
            return _group_sums(t, self.data) / counts.clamp_min(1)
        if self.mean_over == MeanOver.tokens and site == Site.pattern:
            raise UsageError("mean_over=tokens has no meaning for attention patterns (their key axis is positional)")
        axis = position_axis(site)
        real = torch.ones(t.shape[0], t.shape[axis], device=t.device) if mask is None else mask.to(t.device)
        # low-precision activations are summed in float32, then stored in their own dtype
        wide = torch.promote_types(t.dtype, torch.float32)
        weights = real.to(wide).view(t.shape[0], *(t.shape[d] if d == axis else 1 for d in range(1, t.dim())))
        sums, counts = t.to(wide) * weights, weights
        if self.mean_over == MeanOver.tokens:
            sums, counts = sums.sum(axis, keepdim=True), counts.sum(axis, keepdim=True)
        # a position that no reference prompt of a group reaches keeps a zero mean (nothing edits it there)
        means = _group_sums(sums, self.data) / _group_sums(counts, self.data).clamp_min(1)
        return means.to(t.dtype).expand(*means.shape[:axis], t.shape[axis], *means.shape[axis + 1 :])

    def subset(self, rows: Int[Tensor, " rows"], data: TaskData) -> Sources:
        """These values for the prompts `rows` alone, `data` being those prompts (lengths.bucket): the same
        recorded values, each prompt's stored row as before."""
        part = copy.copy(self)
        part.shared_prefix = self.shared_prefix  # over every prompt: where a subset shares at least as much
        part.data, part._rows_on, part._earliest = data, {}, {}
        part.rows = {k: v[rows.cpu()] for k, v in self.rows.items()}
        return part

    @cached_property
    def shared_prefix(self) -> int:
        """How many first positions every counterfactual prompt shares with its clean prompt."""
        return _shared_prefix(self.data.inputs, self.data.counterfactual)

    def value(self, source: str, site: str, layer: int) -> tuple[Tensor, Int[Tensor, " n"]]:
        """(stored values [rows, ...], row of each prompt [n] on the values' device)."""
        values = self.values[(source, site)][layer]
        key = (source, values.device)
        if key not in self._rows_on:
            self._rows_on[key] = self.rows[source].to(values.device)
        return values, self._rows_on[key]

    def earliest(self, iv: Intervention) -> int:
        """The first position, over the prompts, of the role that `iv` names."""
        token = str(iv.token)
        if token not in self._earliest:
            self._earliest[token] = int(self.data.token_positions[token].min())  # type: ignore[index]
        return self._earliest[token]

    def position(self, iv: Intervention) -> Place:
        if iv.token is None:
            return iv.position
        if not self.data.token_positions or iv.token not in self.data.token_positions:
            names = ", ".join(self.data.token_positions or {}) or "none"
            raise ValueError(f"this task names no position '{iv.token}' (it names: {names})")
        return self.data.token_positions[iv.token]

    def source_position(self, iv: Intervention, source: str) -> Place:
        """Where the replacement value is read: the edited position, except for a role that the
        counterfactual prompts hold elsewhere."""
        moved = self.data.counterfactual_positions or {}
        if source == Source.counterfactual and iv.token in moved:
            return moved[iv.token]
        return self.position(iv)


def _shared_prefix(clean: Inputs, other: Inputs | None) -> int:
    """How many first positions every counterfactual prompt shares with its clean prompt (token ids and
    mask): the activations there are the clean ones."""
    if other is None or set(other) != set(clean) or any(other[k].shape != clean[k].shape for k in clean):
        return 0
    ids = clean["input_ids"]
    same = torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
    for k, v in clean.items():
        if v.dim() >= 2 and v.shape[:2] == ids.shape[:2]:
            same &= (v == other[k].to(v.device)).flatten(2).all(-1) if v.dim() > 2 else v == other[k].to(v.device)
    return int(same.long().cumprod(1).sum(1).min())


def _group_sums(t: Tensor, data: TaskData) -> Tensor:
    """[groups, ...]: t [n_reference, ...] summed over the reference prompts of each group (one group if
    the task has none)."""
    if data.groups is None or data.reference_groups is None:
        return t.sum(0, keepdim=True)
    groups = data.reference_groups.to(t.device)
    size = int(max(groups.max(), data.groups.max())) + 1
    return t.new_zeros(size, *t.shape[1:]).index_add_(0, groups, t)


def position_axis(site: str) -> int:
    """The positions' dimension in a site's layout (see site_index; pattern: its query positions)."""
    return 1 if site in (Site.z, *MLP_SITES) else 2


def site_index(site: str, rows: Tensor, pos: Position, heads: Tensor | None) -> tuple:
    """Index of (prompts `rows`, positions, heads) in a site's layout; the result's dims are
    [n, head, ...] for head sites, [n, ...] for mlp and [n, neuron, ...] for neurons ([n, pos, d_mlp],
    `heads` holding the neuron indices)."""
    p = slice(None) if pos is None else pos[:, None] if isinstance(pos, Tensor) else pos  # int or slice as is
    if site == Site.mlp:
        return (rows, pos if isinstance(pos, Tensor) else p)
    r = rows[:, None]
    return (r, p, heads) if site in (Site.z, Site.neurons) else (r, heads, p)


def edit_heads(site: str, heads: Sequence[int], sources: Sources, device: torch.device | None = None) -> Tensor:
    """The heads' index on `device`. k and v live on key/value heads: a query head's edit there touches
    its (shared) kv head. Neuron indices (site neurons) are taken as they are."""
    if site in KV_SITES:
        heads = sorted({sources.kv_head_of(h) for h in heads})
    heads = list(heads)
    if heads and heads == list(range(heads[0], heads[0] + len(heads))):
        # made on the device: a copy from the host waits for the GPU's queue to drain, once per edit
        return torch.arange(heads[0], heads[0] + len(heads), device=device)
    return torch.tensor(heads, dtype=torch.long, device=device)


def apply_edit(x: Tensor, site: str, iv: Intervention, edit: Edit, sources: Sources, offset: int = 0) -> None:
    """Edit one copy [n, ...] in place, in the site's layout (see models/sites.py; mlp [n, pos, d],
    neurons [n, pos, d_mlp]). `offset`: x holds positions offset.. (a suffix run); replacement values
    are read at their own positions all the same."""
    place, source_place = sources.position(iv), sources.source_position(iv, edit.source)
    pos: Position = place
    source_pos: Position = source_place
    if offset:  # a suffix run: x holds positions offset.., the edit changes nothing before them
        pos = slice(None) if place is None else place - offset
    if source_place is None:  # every position x holds: values recorded on longer prompts are cut to them
        source_pos = slice(offset, offset + x.shape[position_axis(site)])
    # positions come with the prompts, on the device the model reads them on; a layer of a model spread
    # over devices (model.device_map) may sit on another
    pos = pos.to(x.device) if isinstance(pos, Tensor) else pos
    rows = torch.arange(x.shape[0], device=x.device)
    heads = None if site == Site.mlp else edit_heads(site, edit.heads, sources, x.device)
    index = site_index(site, rows, pos, heads)
    if edit.source == Source.head:
        other = edit_heads(site, [edit.other_head], sources, x.device)  # type: ignore[list-item]
        x[index] = x[site_index(site, rows, pos, other)].clone()
    elif edit.source == Source.scale:
        factors = torch.tensor(edit.scale, dtype=x.dtype, device=x.device)[heads]
        selected = x[index]
        x[index] = selected * factors.view(1, -1, *([1] * (selected.dim() - 2)))
    elif edit.source == Source.calibrate:
        x[index] = calibrated(x[index], edit.scale[0])
    elif edit.source == Source.calibrate_hidden:
        pattern = x[index]
        real = real_tokens(sources.data).to(pattern.device)
        x[index] = calibrated(pattern, edit.scale[0], hidden_sinks(pattern, real, *edit.scale[1:])[:, :, None, :])
    elif edit.source == Source.zero:
        x[index] = 0.0
    elif edit.source == Source.function:
        x[index] = edited(iv, x[index])
    else:
        value, value_rows = sources.value(edit.source, site, iv.layer)  # type: ignore[arg-type]
        at = source_pos.to(x.device) if isinstance(source_pos, Tensor) else source_pos  # value: recorded at this layer
        x[index] = value[site_index(site, value_rows.to(x.device), at, heads)]


def calibrated(pattern: Tensor, factor: float, sinks: Tensor | None = None) -> Tensor:
    """Attention rows [..., key] calibrated by the rule of Yu et al. 2024 (ACT): the attention on the sink
    keys times `factor`, and what they give up, (1 - factor) times it, added to the other keys in
    proportion to their attention, so each row still sums to one.

    sinks: a bool mask broadcastable to the rows (ACT: the head's hidden sinks, sinks.py);
    default the first key, which on right-padded prompts (tasks/base.py) is every prompt's first real
    token. A row with no attention off the sinks (the first query, which sees only itself) is left as it
    is, as the authors' code leaves it."""
    rows = pattern.to(torch.promote_types(pattern.dtype, torch.float32))
    if sinks is None:
        sinks = torch.zeros(rows.shape[-1], dtype=torch.bool, device=rows.device)
        sinks[0] = True
    on_sinks = rows * sinks
    held = (rows - on_sinks).sum(-1, keepdim=True)
    spread = held > 0
    gain = torch.where(spread, (1 - factor) * on_sinks.sum(-1, keepdim=True) / torch.where(spread, held, 1), 0)
    out = torch.where(sinks, rows * factor, rows * (1 + gain))
    return torch.where(spread, out, rows).to(pattern.dtype)


def edit_hooks(
    chunk: Sequence[Intervention], sources: Sources, n: int, n_heads: int, offset: int = 0
) -> dict[str, Hook]:
    """Hooks, per site, that edit copy i of a stacked batch [g*n, ...] as chunk[i] says."""
    return copy_edit_hooks([[iv] for iv in chunk], sources, n, n_heads, offset)


def first_edited(iv: Intervention, sources: Sources) -> int:
    """The first position an intervention changes in any prompt: its position, or, for a patch of every
    position from the counterfactual prompts, the first position where they differ from the clean ones
    (before it the patch writes the clean values back); 0 where it changes every position."""
    pos = sources.position(iv)
    if isinstance(pos, Tensor):
        return sources.earliest(iv)
    if pos is None:
        edits = iv.edits(sources.n_heads)
        return sources.shared_prefix if edits and all(e.source == Source.counterfactual for e in edits) else 0
    return pos if isinstance(pos, int) and pos >= 0 else 0


def copy_edit_hooks(
    copies: Sequence[Sequence[Intervention]], sources: Sources, n: int, n_heads: int, offset: int = 0
) -> dict[str, Hook]:
    """Hooks, per site, that edit copy i of a stacked batch [g*n, ...] with every intervention in
    copies[i], in order (several interventions on one layer act together); the batch holds positions
    offset.. (see apply_edit)."""
    per_site: dict[str, list[tuple[int, Intervention, Edit]]] = defaultdict(list)
    for i, ivs in enumerate(copies):
        for iv in ivs:
            for edit in iv.edits(n_heads):
                per_site[edit.site].append((i, iv, edit))

    def hook(site: str, items: list[tuple[int, Intervention, Edit]]) -> Hook:
        def edit_site(t: Tensor) -> Tensor:
            stacked = t.unflatten(0, (len(copies), n))
            for i, iv, edit in items:
                apply_edit(stacked[i], site, iv, edit, sources, offset)
            return t

        return edit_site

    return {site: hook(site, items) for site, items in per_site.items()}


def copy_bytes(model: HookedModel, data: TaskData, length: int | None = None, pattern: bool = False) -> int:
    """The memory one stacked copy of the prompts (of their `length` last positions; default all) needs
    at once in a block: its widest per-token activation (the MLP's hidden units), or, where the attention
    runs eagerly, its scores and pattern over every key (models.sites.attention_bytes), whichever is
    larger; the two are not alive together. Eager: where an edit reads or sets the `pattern`, on a
    suffix of positions (after clean prefix keys) or with a softcap on the scores (sites.runs_eagerly);
    there the attention's term grows with the square of the length: at 2048 tokens it is 64 times the
    MLP's on a model with 4 heads and d_mlp 256 (float32). Elsewhere scaled_dot_product_attention makes
    nothing of that size and the MLP's bound holds at every length."""
    n, seq_len = next(iter(data.inputs.values())).shape[:2]
    queries = seq_len if length is None else length
    dtype = next(model.module.parameters()).dtype
    widest = n * queries * model.width * dtype.itemsize
    eager = runs_eagerly(pattern, queries < seq_len, model.sites.attn_softcap)
    return max(widest, n * attention_bytes(model.n_heads, queries, seq_len, dtype, eager))


def chunk_size(
    model: HookedModel, data: TaskData, chunk_mb: float, length: int | None = None, pattern: bool = False
) -> int:
    """How many stacked copies of the prompts (of their `length` last positions; default all; `pattern`:
    some edit is on the pattern) fit in `chunk_mb` of a block's widest activation (copy_bytes); one at
    least."""
    return max(1, int(chunk_mb * 2**20 // copy_bytes(model, data, length, pattern)))


def edits_pattern(interventions: Sequence[Intervention], n_heads: int) -> bool:
    """Does any of the interventions edit (or read from another run) an attention pattern?"""
    return any(edit.site == Site.pattern for iv in interventions for edit in iv.edits(n_heads))
