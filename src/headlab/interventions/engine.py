"""The sweep executor: exact, batched, and started from cached activations.

One clean pass caches the residual stream entering every block. All interventions on layer l then run
together: the cached input of block l is stacked g times (one copy per intervention), block l edits
each copy's z as its intervention says, blocks l+1.. run on the stacked batch, and logits are computed
at the positions the metrics read only. Layers before l are never recomputed. `naive=True` runs one
full forward pass per intervention instead: the reference the fast path is tested against.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from . import Edit, Intervention


class Sources:
    """Replacement values for z, per layer, computed once per sweep and only when some method needs them."""

    def __init__(self, model: HookedModel, data: TaskData, needed: set[str], seed: int = 0):
        self.zero = "zero" in needed
        self.mean: dict[int, Tensor] = {}
        self.reference: dict[int, Tensor] = {}
        self.counterfactual: dict[int, Tensor] = {}
        if needed & {"mean", "reference"}:
            if data.reference is None:
                raise ValueError("this task provides no reference set for mean/resample ablation")
            z = model.record(data.reference)
            n_ref = next(iter(data.reference.values())).shape[0]
            if n_ref == data.n:
                pick = torch.arange(data.n)  # the task matched reference i to prompt i (same length)
            else:
                pick = torch.from_numpy(np.random.default_rng(seed).integers(0, n_ref, data.n))
            for layer, value in z.items():
                self.mean[layer] = value.mean(0)
                self.reference[layer] = value[pick]
        if "counterfactual" in needed:
            if data.counterfactual is None:
                raise ValueError("this task provides no counterfactual prompts for patching")
            self.counterfactual = model.record(data.counterfactual)

    def value(self, source: str, layer: int) -> Optional[Tensor]:
        """[n, pos, head, d_head] or [pos, head, d_head] (broadcast over prompts); None means zero."""
        return None if source == "zero" else getattr(self, source)[layer]


def _apply(x: Tensor, site: str, iv: Intervention, edit: Edit, sources: Sources) -> None:
    """Edit one copy in place. x: z [n, pos, head, d] | pattern [n, head, q, k] | v [n, kv_head, pos, d]."""
    pos = slice(None) if iv.position is None else iv.position
    heads = list(edit.heads)
    index = (slice(None), pos, heads) if site == "z" else (slice(None), heads, pos)
    if edit.source == "head":
        x[index] = x[(slice(None), [edit.other_head], pos)].clone()
    elif edit.source == "scale":
        factors = torch.tensor(edit.scale, dtype=x.dtype, device=x.device)[heads]
        x[index] = x[index] * factors.view(-1, 1)
    else:
        value = sources.value(edit.source, iv.layer)
        if value is None:
            x[index] = 0.0
        elif value.dim() == 3:  # a mean over prompts: the same for every prompt
            x[index] = value[index[1:]]
        else:
            x[index] = value[index]


def _edit_fns(chunk: Sequence[Intervention], sources: Sources, n: int, n_heads: int) -> dict[str, Callable]:
    """Hooks, per head site, that edit copy i of a stacked batch [g*n, ...] as chunk[i] says."""
    per_site: dict[str, list[tuple[int, Intervention, Edit]]] = defaultdict(list)
    for i, iv in enumerate(chunk):
        for edit in iv.edits(n_heads):
            per_site[edit.site].append((i, iv, edit))

    def hook(site: str, items: list) -> Callable[[Tensor], Tensor]:
        def edit_site(t: Tensor) -> Tensor:
            stacked = t.unflatten(0, (len(chunk), n))
            for i, iv, edit in items:
                _apply(stacked[i], site, iv, edit, sources)
            return t

        return edit_site

    return {site: hook(site, items) for site, items in per_site.items()}


def _through_last_read(data: TaskData) -> TaskData:
    """Drop positions after the last one any metric reads: in a causal model they cannot matter."""
    keep = int(data.positions.max()) + 1
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
    """Per-prompt task quantities for every intervention: [n_interventions, n_prompts, n_quantities]."""
    data = _through_last_read(data)
    n = data.n
    seq_len = next(iter(data.inputs.values())).shape[1]
    out: list[Optional[Tensor]] = [None] * len(interventions)
    with torch.inference_mode():
        needed = {e.source for iv in interventions for e in iv.edits(model.n_heads)}
        sources = Sources(model, data, needed, seed)
        if naive:
            _run_naive(model, task, data, interventions, sources, out, show_progress)
        else:
            trace = model.trace(data.inputs)
            by_layer: dict[int, list[int]] = defaultdict(list)
            for i, iv in enumerate(interventions):
                if iv.intervention == "none":
                    out[i] = task.per_prompt(model.readout(trace.resid_final, data.positions), data)
                else:
                    by_layer[iv.layer].append(i)
            bytes_per_copy = n * seq_len * model.width * trace.resid_final.element_size()
            per_chunk = max(1, int(chunk_mb * 2**20 // bytes_per_copy))
            chunks = [(layer, idx[s : s + per_chunk]) for layer, idx in sorted(by_layer.items())
                      for s in range(0, len(idx), per_chunk)]  # fmt: skip
            with progress_bar("sweep", total=len(chunks), enabled=show_progress) as bar:
                for done, (layer, idx) in enumerate(chunks, 1):
                    chunk = [interventions[i] for i in idx]
                    h = trace.resid_pre[layer].repeat(len(chunk), 1, 1)
                    read = data.positions.repeat(len(chunk), 1)
                    with model.sites.hooks(layer, **_edit_fns(chunk, sources, n, model.n_heads)):
                        h = model.run_blocks(h, layer, trace, copies=len(chunk), read=read)
                    logits = model.readout(h, read)
                    quantities = task.per_prompt(logits.unflatten(0, (len(chunk), n)), data)
                    for j, i in enumerate(idx):
                        out[i] = quantities[j]
                    bar.update(done)
    return torch.stack(out)  # type: ignore[arg-type]


def _run_naive(model, task, data, interventions, sources, out, show_progress) -> None:
    rows = torch.arange(data.n).unsqueeze(1)
    with progress_bar("sweep (naive)", total=len(interventions), enabled=show_progress) as bar:
        for i, iv in enumerate(interventions):
            if iv.intervention == "none":
                logits = model.forward(data.inputs)
            else:
                with model.sites.hooks(iv.layer, **_edit_fns([iv], sources, data.n, model.n_heads)):
                    logits = model.forward(data.inputs)
            out[i] = task.per_prompt(logits[rows, data.positions], data)
            bar.update(i + 1)
