"""Attribution patching (Nanda 2023; Kramar et al. 2024): a first-order estimate of activation patching.

A forward and a backward pass on the clean prompts (the backward one block at a time: _site_gradients)
give, for every head site a, the gradient of the task's smooth quantity m (IOI: the logit difference)
with respect to a; patching a to its counterfactual value a' then changes m by about (a' - a) . dm/da.
Summed over the positions and heads an intervention touches, that is its estimate; the task's other
quantities have no estimate (NaN). Rows keep method=attribution, so a table never passes these numbers off
as exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import UsageError
from ..models.hooked import HookedModel
from ..models.sites import Hook
from ..tasks import Task, TaskData
from ..vocabulary import Site
from .edits import Sources, edit_heads, site_index
from .plan import Intervention
from .readout import CHUNK_MB, read_quantities, rows_quantities

PROMPTS_PER_PASS = 32  # prompts are independent: passes over slices bound the trace's and a block's graph's memory


def estimate(
    model: HookedModel, task: Task, data: TaskData, interventions: Sequence[Intervention]
) -> tuple[Tensor, list[Tensor]]:
    """(the clean run's quantities [n, Q], each intervention's estimated quantities [n, Q])."""
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
        quantities, gradients = _site_gradients(model, task, part, sites, col)
        clean.append(quantities)
        for (site, layer), (value, grad) in gradients.items():
            d = torch.zeros_like(value) if grad is None else (patched[site][layer] - value) * grad
            deltas.setdefault((site, layer), []).append(d)
    clean_q = torch.cat(clean)
    joined = {key: torch.cat(parts) for key, parts in deltas.items()}
    sources = Sources(model, data, set())
    out = []
    for iv in interventions:
        site = iv.site or Site.z
        d = joined[(site, iv.layer)]  # type: ignore[index]
        heads = edit_heads(site, range(model.n_heads) if iv.head is None else [iv.head], sources, d.device)
        rows = torch.arange(data.n, device=d.device)
        change = d[site_index(site, rows, sources.position(iv), heads)].flatten(1).sum(1)
        q = torch.full_like(clean_q, float("nan"))
        q[:, col] = clean_q[:, col] + change
        out.append(q)
    return clean_q, out


def _site_gradients(
    model: HookedModel, task: Task, data: TaskData, sites: Sequence[str], col: int
) -> tuple[Tensor, dict[tuple[str, int], tuple[Tensor, Tensor | None]]]:
    """The clean quantities [n, Q] and, per (site, layer), the site's clean value and the gradient of
    quantity `col` (summed over the prompts) with respect to it (None: the quantity does not depend on it).

    One clean pass keeps each block's input; the gradient then goes back one block at a time, each block
    run again from its kept input: the graph of one block is alive at once, not the whole model's (at
    2048 tokens the whole graph of a 7B model would take gigabytes a prompt), for one block's forward
    pass more in all."""
    with torch.no_grad():  # not inference_mode: the kept inputs meet autograd below
        trace = model.trace(data.inputs)
    out: dict[tuple[str, int], tuple[Tensor, Tensor | None]] = {}
    with torch.enable_grad(), model.frozen():
        h = trace.resid_final.detach().requires_grad_()
        # the quantity's rows alone where the task names them: no backward through the whole vocabulary
        at_rows = rows_quantities(model, task, h, data.positions, data, [col], CHUNK_MB)
        if at_rows is None:
            quantities = task.per_prompt(model.readout(h, data.positions), data)
            value = quantities[:, col]
        else:
            with torch.no_grad():
                quantities = read_quantities(model, task, h, data.positions, data, CHUNK_MB)[0]
            value = at_rows[0, :, 0]
        (grad,) = torch.autograd.grad(value.sum(), h)
        for layer in reversed(range(model.n_layers)):
            x = trace.resid_pre[layer].detach().requires_grad_()
            store: dict[tuple[str, int], Tensor] = {}
            with model.hooks(layer, **{s: _keep(store, s, layer) for s in sites}):
                h = model.run_blocks(x, layer, trace, stop=layer + 1)
            keys = list(store)
            grads = torch.autograd.grad(h, [x, *(store[k] for k in keys)], grad.to(h.device), allow_unused=True)
            for key, g in zip(keys, grads[1:]):
                out[key] = (store[key].detach(), g)
            grad = torch.zeros_like(x) if grads[0] is None else grads[0]
    return quantities.detach(), out


def _keep(store: dict[tuple[str, int], Tensor], site: str, layer: int) -> Hook:
    def hook(t: Tensor) -> Tensor:
        if not t.requires_grad:  # a site that does not depend on the block's input: make it a leaf of the graph
            t = t.detach().requires_grad_()
        store[(site, layer)] = t
        return t

    return hook
