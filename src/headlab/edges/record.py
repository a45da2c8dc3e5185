"""What every edge method needs from one forward pass: each sender's output, and the metric.

A sender's output is what it adds to the residual stream: the input node, the residual entering block 0;
head h of layer l, z[:, :, h] @ W_O[h] (the output bias is the same in every run and cancels from every
difference); an MLP, its block's output. The residual stream is their sum plus those constant biases.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UsageError
from ..models.hooked import HookedModel, Trace
from ..tasks import Inputs, Task, TaskData
from ..vocabulary import Site
from .graph import EdgeGraph


@dataclass
class Recording:
    trace: Trace
    z: dict[int, Tensor]  # layer -> [n, pos, head, d_head]
    mlp: dict[int, Tensor]  # layer -> [n, pos, d_model]


def record(model: HookedModel, graph: EdgeGraph, inputs: Inputs) -> Recording:
    """One forward pass keeping every block's input, every layer's z and every MLP's output."""
    mlp: dict[int, Tensor] = {}

    def keep(layer: int):
        def hook(t: Tensor) -> Tensor:
            mlp[layer] = t.detach()
            return t

        return hook

    with ExitStack() as stack:
        z = stack.enter_context(model.sites.record((Site.z,)))
        for layer in graph.mlp_layers:
            stack.enter_context(model.hooks(layer, mlp=keep(layer)))
        trace = model.trace(inputs)
    return Recording(trace, {layer: t.detach() for (_, layer), t in z.items()}, mlp)


def head_outputs(model: HookedModel, layer: int, z: Tensor) -> Tensor:
    """[head, n, pos, d_model]: each head's output into the residual stream."""
    return torch.einsum("bphd,hdm->hbpm", z, model.sites.W_O(layer).to(z.dtype))


def sender_outputs(model: HookedModel, graph: EdgeGraph, rec: Recording) -> Tensor:
    """[senders, n, pos, d_model] in the graph's sender order."""
    parts = [rec.trace.resid_pre[0].detach().unsqueeze(0)]
    for layer in range(graph.n_layers):
        parts.append(head_outputs(model, layer, rec.z[layer]))
        if layer in graph.mlp_layers:
            parts.append(rec.mlp[layer].unsqueeze(0))
    return torch.cat(parts)


def metric_column(task: Task) -> int:
    if task.smooth_quantity is None:
        raise UsageError(
            f"task {task.name} has no smooth metric (a logit difference or a loss) to score circuits by; "
            "tasks that have one: ioi, prompts, recall_reasoning"
        )
    return task.quantities.index(task.smooth_quantity)


def check_pairs(data: TaskData) -> Inputs:
    """The counterfactual prompts, refused in one line where edges cannot pair them with the clean ones."""
    if data.counterfactual is None:
        raise UsageError("edge circuits need a task with counterfactual prompts")
    if data.counterfactual_positions:
        raise UsageError("edge circuits need counterfactual prompts laid out like the clean ones")
    clean, corrupt = data.inputs["input_ids"], data.counterfactual["input_ids"]
    if clean.shape != corrupt.shape:
        raise UsageError(
            f"edge circuits need counterfactual prompts as long as the clean ones ({tuple(corrupt.shape)} vs "
            f"{tuple(clean.shape)} tokens)"
        )
    return data.counterfactual


def metric(model: HookedModel, task: Task, data: TaskData, resid_final: Tensor, column: int) -> Tensor:
    """The task's smooth quantity per prompt [n] (per copy [copies, n] for a stacked batch)."""
    copies = resid_final.shape[0] // data.n
    logits = model.readout(resid_final, data.positions.repeat(copies, 1))
    values = task.per_prompt(logits.unflatten(0, (copies, data.n)), data)[..., column]
    return values if copies > 1 else values[0]
