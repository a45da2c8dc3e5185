"""Attribution patching (Nanda 2023; Kramar et al. 2024): a first-order estimate of activation patching.

One forward and one backward pass on the clean prompts give, for every head site a, the gradient of the
task's smooth quantity m (IOI: the logit difference) with respect to a; patching a to its counterfactual
value a' then changes m by about (a' - a) . dm/da. Summed over the positions and heads an intervention
touches, that is its estimate; the task's other quantities have no estimate (NaN). Rows keep
method=attribution, so a table never passes these numbers off as exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import Tensor

from ..errors import UsageError
from ..models.hooked import HookedModel
from ..models.sites import Hook
from ..tasks import Task, TaskData
from ..vocabulary import Site
from .edits import Sources, edit_heads, site_index
from .plan import Intervention

PROMPTS_PER_PASS = 32  # prompts are independent: backward passes over slices bound the graph's memory


def estimate(model: HookedModel, task: Task, data: TaskData, interventions: Sequence[Intervention]) -> list[Tensor]:
    if task.smooth_quantity is None:
        raise UsageError(f"task {task.name} names no smooth quantity for attribution patching")
    if data.counterfactual is None:
        raise UsageError("this task provides no counterfactual prompts for patching")
    if data.counterfactual_positions:
        # the estimate pairs each clean activation with the counterfactual one at the same position
        raise ValueError("attribution patching needs counterfactual prompts laid out like the clean ones")
    col = task.quantities.index(task.smooth_quantity)
    sites = sorted({iv.site or Site.z for iv in interventions})
    deltas: dict[tuple[str, int], list[Tensor]] = {}
    clean: list[Tensor] = []
    for start in range(0, data.n, PROMPTS_PER_PASS):
        part = data.take(slice(start, start + PROMPTS_PER_PASS))
        with torch.inference_mode():
            patched = {site: model.record(part.counterfactual, site) for site in sites}  # type: ignore[arg-type]
        store: dict[tuple[str, int], Tensor] = {}
        with torch.enable_grad(), ExitStack() as stack:
            for layer in range(model.n_layers):
                stack.enter_context(model.hooks(layer, **{s: _keep(store, s, layer) for s in sites}))
            logits = model.readout(model.forward_blocks(part.inputs), part.positions)
            quantities = task.per_prompt(logits, part)
            keys = list(store)
            grads = torch.autograd.grad(quantities[:, col].sum(), [store[k] for k in keys], allow_unused=True)
        clean.append(quantities.detach())
        for key, grad in zip(keys, grads):
            site, layer = key
            d = torch.zeros_like(store[key]) if grad is None else (patched[site][layer] - store[key].detach()) * grad
            deltas.setdefault(key, []).append(d)
    clean_q = torch.cat(clean)
    joined = {key: torch.cat(parts) for key, parts in deltas.items()}
    sources = Sources(model, data, set())
    rows = torch.arange(data.n)
    out = []
    for iv in interventions:
        site = iv.site or Site.z
        heads = edit_heads(site, range(model.n_heads) if iv.head is None else [iv.head], sources)
        d = joined[(site, iv.layer)]  # type: ignore[index]
        change = d[site_index(site, rows.to(d.device), sources.position(iv), heads.to(d.device))].flatten(1).sum(1)
        q = torch.full_like(clean_q, float("nan"))
        q[:, col] = clean_q[:, col] + change
        out.append(q)
    return out


def _keep(store: dict[tuple[str, int], Tensor], site: str, layer: int) -> Hook:
    def hook(t: Tensor) -> Tensor:
        if not t.requires_grad:  # a model with frozen weights: make the site a leaf of the graph
            t = t.detach().requires_grad_()
        store[(site, layer)] = t
        return t

    return hook
