"""The sweep executor: exact, batched, and started from cached activations.

One clean pass caches the residual stream entering every block. All interventions on layer l then run
together: the cached input of block l is stacked g times (one copy per intervention), block l edits
each copy's z as its intervention says, blocks l+1.. run on the stacked batch, and logits are computed
at the positions the metrics read only. Layers before l are never recomputed. `naive=True` runs one
full forward pass per intervention instead: the reference the fast path is tested against.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from . import Intervention


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
            z = _record_z(model, data.reference)
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
            self.counterfactual = _record_z(model, data.counterfactual)

    def value(self, source: str, layer: int) -> Optional[Tensor]:
        """[n, pos, head, d_head] or [pos, head, d_head] (broadcast over prompts); None means zero."""
        return None if source == "zero" else getattr(self, source)[layer]


def _record_z(model: HookedModel, inputs: dict[str, Tensor]) -> dict[int, Tensor]:
    with model.sites.record(("z",)) as store:
        model.forward(inputs)
    return {layer: t.contiguous() for (_, layer), t in store.items()}


def _edit_fn(chunk: Sequence[Intervention], sources: Sources, n: int) -> Callable[[Tensor], Tensor]:
    """z [g*n, pos, head, d_head] -> z with copy i edited as chunk[i] says."""

    def edit(z: Tensor) -> Tensor:
        stacked = z.unflatten(0, (len(chunk), n))
        for i, iv in enumerate(chunk):
            pos = slice(None) if iv.position is None else iv.position
            head = slice(None) if iv.head is None else iv.head
            value = sources.value(iv.source, iv.layer)
            if value is None:
                stacked[i, :, pos, head] = 0.0
            elif value.dim() == 3:  # a mean over prompts: the same for every prompt
                stacked[i, :, pos, head] = value[pos, head]
            else:
                stacked[i, :, pos, head] = value[:, pos, head]
        return z

    return edit


def execute(
    model: HookedModel,
    task: Task,
    data: TaskData,
    interventions: Sequence[Intervention],
    batch_tokens: int = 65536,
    naive: bool = False,
    show_progress: bool = False,
    seed: int = 0,
) -> Tensor:
    """Per-prompt task quantities for every intervention: [n_interventions, n_prompts, n_quantities]."""
    n = data.n
    seq_len = next(iter(data.inputs.values())).shape[1]
    out: list[Optional[Tensor]] = [None] * len(interventions)
    with torch.inference_mode():
        sources = Sources(model, data, {iv.source for iv in interventions if iv.intervention != "none"}, seed)
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
            per_chunk = max(1, batch_tokens // (n * seq_len))
            chunks = [(layer, idx[s : s + per_chunk]) for layer, idx in sorted(by_layer.items())
                      for s in range(0, len(idx), per_chunk)]  # fmt: skip
            with progress_bar("sweep", total=len(chunks), enabled=show_progress) as bar:
                for done, (layer, idx) in enumerate(chunks, 1):
                    chunk = [interventions[i] for i in idx]
                    h = trace.resid_pre[layer].repeat(len(chunk), 1, 1)
                    with model.sites.hooks(layer, z=_edit_fn(chunk, sources, n)):
                        h = model.run_blocks(h, layer, trace, copies=len(chunk))
                    logits = model.readout(h, data.positions.repeat(len(chunk), 1))
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
                with model.sites.hooks(iv.layer, z=_edit_fn([iv], sources, data.n)):
                    logits = model.forward(data.inputs)
            out[i] = task.per_prompt(logits[rows, data.positions], data)
            bar.update(i + 1)
