"""The sweep executor: exact, batched, and started from cached activations.

One clean pass caches the residual stream entering every block. All interventions on layer l then run
together: the cached input of block l is stacked g times (one copy per intervention), block l edits
each copy's z as its intervention says, blocks l+1.. run on the stacked batch, and logits are computed
at the positions the metrics read only. Layers before l are never recomputed. `naive=True` runs one
full forward pass per intervention instead: the reference the fast path is tested against.

`execute_joint` applies groups of interventions at several layers together (circuit knockouts): one full
forward pass per group, with every involved layer's hooks installed at once.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack
from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from . import Edit, Intervention


Position = Union[None, int, Tensor]  # every position | one index | one per prompt [n]


class Sources:
    """Replacement values per (source, site, layer), recorded once per sweep and only when needed.

    A value is stored with as few rows as it needs (the reference set once, one mean per group) and
    `rows[source]` ([n]) says which stored row stands in for each prompt."""

    def __init__(self, model: HookedModel, data: TaskData, needed: set[tuple[str, str]], seed: int = 0):
        self.data = data
        self.kv_head_of = model.sites.kv_head_of
        self.values: dict[tuple[str, str], dict[int, Tensor]] = {}
        self.rows: dict[str, Tensor] = {"counterfactual": torch.arange(data.n), "clean": torch.arange(data.n)}
        wanted = {(src, site) for src, site in needed if src not in ("zero", "head", "scale")}
        if any(src in ("mean", "reference") for src, _ in wanted) and data.reference is None:
            raise ValueError("this task provides no reference set for mean/resample ablation")
        if any(src == "counterfactual" for src, _ in wanted) and data.counterfactual is None:
            raise ValueError("this task provides no counterfactual prompts for patching")
        if data.reference is not None:
            n_ref = next(iter(data.reference.values())).shape[0]
            if n_ref == data.n:
                self.rows["reference"] = torch.arange(data.n)  # the task matched reference i to prompt i
            else:
                self.rows["reference"] = torch.from_numpy(np.random.default_rng(seed).integers(0, n_ref, data.n))
            if data.groups is not None and data.reference_groups is not None:
                self.rows["mean"] = data.groups.cpu()
            else:
                self.rows["mean"] = torch.zeros(data.n, dtype=torch.long)
        inputs = {"clean": data.inputs, "counterfactual": data.counterfactual, "reference": data.reference}
        for src, site in sorted(wanted):
            if src == "mean":
                continue
            self.values[(src, site)] = model.record(inputs[src], site)
        for _, site in sorted(w for w in wanted if w[0] == "mean"):
            recorded = self.values.get(("reference", site)) or model.record(data.reference, site)
            self.values[("mean", site)] = {layer: self._means(t) for layer, t in recorded.items()}

    def _means(self, t: Tensor) -> Tensor:
        """[groups, ...]: the mean over the reference prompts of each group (one group if none)."""
        if self.data.groups is None or self.data.reference_groups is None:
            return t.mean(0, keepdim=True)
        groups = self.data.reference_groups.to(t.device)
        size = int(max(groups.max(), self.data.groups.max())) + 1
        sums = t.new_zeros(size, *t.shape[1:]).index_add_(0, groups, t)
        counts = torch.bincount(groups, minlength=size).clamp_min(1).to(t.dtype)
        return sums / counts.view(-1, *([1] * (t.dim() - 1)))

    def value(self, source: str, site: str, layer: int) -> tuple[Tensor, Tensor]:
        """(stored values [rows, ...], row of each prompt [n])."""
        return self.values[(source, site)][layer], self.rows[source]

    def position(self, iv: Intervention) -> Position:
        if iv.token is None:
            return iv.position
        if not self.data.token_positions or iv.token not in self.data.token_positions:
            names = ", ".join(self.data.token_positions or {}) or "none"
            raise ValueError(f"this task names no position '{iv.token}' (it names: {names})")
        return self.data.token_positions[iv.token]

    def source_position(self, iv: Intervention, source: str) -> Position:
        """Where the replacement value is read: the edited position, except for a role that the
        counterfactual prompts hold elsewhere."""
        moved = self.data.counterfactual_positions or {}
        if source == "counterfactual" and iv.token in moved:
            return moved[iv.token]
        return self.position(iv)


def site_index(site: str, rows: Tensor, pos: Position, heads: Optional[Tensor]) -> tuple:
    """Index of (prompts `rows`, positions, heads) in a site's layout; the result's dims are
    [n, head, ...] for head sites, [n, ...] for mlp and [n, neuron, ...] for neurons ([n, pos, d_mlp],
    `heads` holding the neuron indices)."""
    p = slice(None) if pos is None else pos[:, None] if isinstance(pos, Tensor) else pos
    if site == "mlp":
        return (rows, pos if isinstance(pos, Tensor) else p)
    r = rows[:, None]
    return (r, p, heads) if site in ("z", "neurons") else (r, heads, p)


def _heads(site: str, heads: Sequence[int], sources: Sources) -> Tensor:
    """k and v live on key/value heads: a query head's edit there touches its (shared) kv head.
    Neuron indices (site "neurons") are taken as they are."""
    if site in ("k", "v"):
        heads = sorted({sources.kv_head_of(h) for h in heads})
    return torch.tensor(list(heads), dtype=torch.long)


def _apply(x: Tensor, site: str, iv: Intervention, edit: Edit, sources: Sources) -> None:
    """Edit one copy [n, ...] in place, in the site's layout (see models/sites.py; mlp [n, pos, d],
    neurons [n, pos, d_mlp])."""
    pos = sources.position(iv)
    rows = torch.arange(x.shape[0], device=x.device)
    heads = None if site == "mlp" else _heads(site, edit.heads, sources).to(x.device)
    index = site_index(site, rows, pos, heads)
    if edit.source == "head":
        other = _heads(site, [edit.other_head], sources).to(x.device)  # type: ignore[list-item]
        x[index] = x[site_index(site, rows, pos, other)].clone()
    elif edit.source == "scale":
        factors = torch.tensor(edit.scale, dtype=x.dtype, device=x.device)[heads]
        selected = x[index]
        x[index] = selected * factors.view(1, -1, *([1] * (selected.dim() - 2)))
    elif edit.source == "zero":
        x[index] = 0.0
    else:
        value, value_rows = sources.value(edit.source, site, iv.layer)  # type: ignore[arg-type]
        x[index] = value[site_index(site, value_rows.to(x.device), sources.source_position(iv, edit.source), heads)]


def _edit_fns(chunk: Sequence[Intervention], sources: Sources, n: int, n_heads: int) -> dict[str, Callable]:
    """Hooks, per site, that edit copy i of a stacked batch [g*n, ...] as chunk[i] says."""
    return _copy_edit_fns([[iv] for iv in chunk], sources, n, n_heads)


def _copy_edit_fns(
    copies: Sequence[Sequence[Intervention]], sources: Sources, n: int, n_heads: int
) -> dict[str, Callable]:
    """Hooks, per site, that edit copy i of a stacked batch [g*n, ...] with every intervention in
    copies[i], in order (several interventions on one layer act together)."""
    per_site: dict[str, list[tuple[int, Intervention, Edit]]] = defaultdict(list)
    for i, ivs in enumerate(copies):
        for iv in ivs:
            for edit in iv.edits(n_heads):
                per_site[edit.site].append((i, iv, edit))

    def hook(site: str, items: list) -> Callable[[Tensor], Tensor]:
        def edit_site(t: Tensor) -> Tensor:
            stacked = t.unflatten(0, (len(copies), n))
            for i, iv, edit in items:
                _apply(stacked[i], site, iv, edit, sources)
            return t

        return edit_site

    return {site: hook(site, items) for site, items in per_site.items()}


def _through_last_read(data: TaskData) -> TaskData:
    """Drop positions after the last one any metric reads: in a causal model they cannot matter."""
    reads = [data.positions.max(), *(p.max() for p in (data.counterfactual_positions or {}).values())]
    keep = int(max(reads)) + 1
    seq_len = next(iter(data.inputs.values())).shape[1]
    if keep >= seq_len:
        return data
    cut = lambda inputs: inputs and {k: v[:, :keep] if v.dim() >= 2 and v.shape[1] == seq_len else v  # noqa: E731
                                     for k, v in inputs.items()}  # fmt: skip
    return replace(data, inputs=cut(data.inputs), counterfactual=cut(data.counterfactual),
                   reference=cut(data.reference))  # fmt: skip


def execute(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    chunk_mb: float = 32.0,
    naive: bool = False,
    show_progress: bool = False,
    seed: int = 0,
) -> Tensor:
    """Per-prompt task quantities for every intervention: [n_interventions, n_prompts, n_quantities].

    Path patching and attribution patching rows go to their own executors (path.py, attribution.py)."""
    from .attribution import estimate
    from .path import run_path

    data = _through_last_read(data)
    out: list[Optional[Tensor]] = [None] * len(interventions)
    kinds: dict[str, list[int]] = defaultdict(list)
    for i, iv in enumerate(interventions):
        kinds["path" if iv.method == "path" else "attribution" if iv.method == "attribution" else "exact"].append(i)
    if kinds["attribution"]:
        for i, q in zip(kinds["attribution"], estimate(model, task, data, [interventions[i] for i in kinds["attribution"]])):
            out[i] = q
    with torch.inference_mode():
        needed = {(e.source, e.site) for i in kinds["exact"] for e in interventions[i].edits(model.n_heads)}
        if kinds["path"]:
            needed |= {("reference", "z"), ("clean", "z")}
        sources = Sources(model, data, needed, seed)
        exact = [interventions[i] for i in kinds["exact"]]
        if naive:
            results = _run_naive(model, task, data, exact, sources, show_progress)
        else:
            results = _run_stacked(model, task, data, exact, sources, chunk_mb, show_progress)
        for i, q in zip(kinds["exact"], results):
            out[i] = q
        if kinds["path"]:
            paths = run_path(model, task, data, [interventions[i] for i in kinds["path"]], sources, chunk_mb,
                             show_progress)  # fmt: skip
            for i, q in zip(kinds["path"], paths):
                out[i] = q
    return torch.stack(out)  # type: ignore[arg-type]


def chunk_size(model: HookedModel, data: TaskData, chunk_mb: float) -> int:
    """How many stacked copies of the prompts fit in `chunk_mb` of the widest activation."""
    n, seq_len = next(iter(data.inputs.values())).shape[:2]
    bytes_per_copy = n * seq_len * model.width * next(model.module.parameters()).element_size()
    return max(1, int(chunk_mb * 2**20 // bytes_per_copy))


def _run_stacked(model, task, data, interventions, sources, chunk_mb, show_progress) -> list[Tensor]:
    n = data.n
    out: list[Optional[Tensor]] = [None] * len(interventions)
    trace = model.trace(data.inputs)
    by_layer: dict[int, list[int]] = defaultdict(list)
    for i, iv in enumerate(interventions):
        if iv.intervention == "none":
            out[i] = task.per_prompt(model.readout(trace.resid_final, data.positions), data)
        else:
            by_layer[iv.layer].append(i)
    per_chunk = chunk_size(model, data, chunk_mb)
    chunks = [(layer, idx[s : s + per_chunk]) for layer, idx in sorted(by_layer.items())
              for s in range(0, len(idx), per_chunk)]  # fmt: skip
    with progress_bar("sweep", total=len(chunks), enabled=show_progress) as bar:
        for done, (layer, idx) in enumerate(chunks, 1):
            chunk = [interventions[i] for i in idx]
            h = trace.resid_pre[layer].repeat(len(chunk), 1, 1)
            read = data.positions.repeat(len(chunk), 1)
            fns = _edit_fns(chunk, sources, n, model.n_heads)
            # an MLP or neuron edit on the last layer needs the MLP at every position, not only at the
            # read ones (the edit indexes positions of the full sequence)
            only_read = None if ("mlp" in fns or "neurons" in fns) and layer == model.n_layers - 1 else read
            with model.hooks(layer, **fns):
                h = model.run_blocks(h, layer, trace, copies=len(chunk), read=only_read)
            quantities = task.per_prompt(model.readout(h, read).unflatten(0, (len(chunk), n)), data)
            for j, i in enumerate(idx):
                out[i] = quantities[j]
            bar.update(done)
    return out  # type: ignore[return-value]


def _run_naive(model, task, data, interventions, sources, show_progress) -> list[Tensor]:
    return _run_groups(model, task, data, [[iv] for iv in interventions], sources, "sweep (naive)", show_progress)


def _run_groups(model, task, data, groups, sources, label: str, show_progress: bool) -> list[Tensor]:
    """One full forward pass per group, with the hooks of every layer the group edits installed at once
    (several interventions on one layer all apply, in order); logits only at the read positions."""
    out = []
    with progress_bar(label, total=len(groups), enabled=show_progress) as bar:
        for done, group in enumerate(groups, 1):
            by_layer: dict[int, list[Intervention]] = defaultdict(list)
            for iv in group:
                if iv.intervention != "none":
                    by_layer[iv.layer].append(iv)  # type: ignore[index]
            with ExitStack() as stack:
                for layer, ivs in sorted(by_layer.items()):
                    stack.enter_context(model.hooks(layer, **_copy_edit_fns([ivs], sources, data.n, model.n_heads)))
                h = model.forward_blocks(data.inputs)
            out.append(task.per_prompt(model.readout(h, data.positions), data))
            bar.update(done)
    return out


def execute_joint(
    model: HookedModel,
    task: Task,
    data: TaskData,
    groups: Sequence[Sequence[Intervention]],
    show_progress: bool = False,
    seed: int = 0,
) -> Tensor:
    """Per-prompt task quantities [len(groups), n_prompts, n_quantities], each group's interventions
    applied together in one full forward pass (a circuit knockout): hooks go on every layer the group
    touches at once, and several interventions on one layer all apply, in the group's order. An empty
    group is the clean run. Replacement values come from one Sources, as in execute()."""
    data = _through_last_read(data)
    for group in groups:
        for iv in group:
            # path and attribution patching are not edits at one layer; they have their own executors
            if iv.intervention != "none" and (iv.layer is None or iv.method in ("path", "attribution")):
                raise ValueError(f"execute_joint takes exact single-layer interventions, not {iv}")
    with torch.inference_mode():
        needed = {(e.source, e.site) for group in groups for iv in group for e in iv.edits(model.n_heads)}
        sources = Sources(model, data, needed, seed)
        return torch.stack(_run_groups(model, task, data, groups, sources, "joint interventions", show_progress))
