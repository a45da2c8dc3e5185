"""What every edge method needs from one forward pass: each sender's output, and the metric.

A sender's output is what it adds to the residual stream: the input node, the residual entering block 0;
head h of layer l, z[:, :, h] @ W_O[h] (the output bias is the same in every run and cancels from every
difference); an MLP, its block's output. The residual stream is their sum plus those constant biases.
On a post-norm model (postnorm.py) the MLP's output is taken after its norm, and a head's is r_h =
z_h W_O[h] before its layer's norm (mib) or its share of the normalised output (shares); what one edge
alone then adds to its receiver is `patch_deltas`.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import UsageError
from ..interventions.readout import CHUNK_MB, rows_quantities
from ..models.hooked import HookedModel, Trace
from ..tasks import Inputs, Task, TaskData
from ..vocabulary import Site
from .graph import EdgeGraph
from .postnorm import attn_norm, attn_output, mlp_output, renormed, shares


@dataclass
class Recording:
    trace: Trace
    z: dict[int, Tensor]  # layer -> [n, pos, head, d_head]
    mlp: dict[int, Tensor]  # layer -> [n, pos, d_model]
    # post-norm models: layer -> (A, its normalised output), the attention's output before and after its norm
    attn: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


def record(model: HookedModel, graph: EdgeGraph, inputs: Inputs) -> Recording:
    """One forward pass keeping every block's input, every layer's z and every MLP node's output."""
    mlp: dict[int, Tensor] = {}
    attn: dict[int, tuple[Tensor, Tensor]] = {}

    def keep(layer: int):
        def hook(t: Tensor) -> Tensor:
            mlp[layer] = t.detach()
            return t

        return hook

    def keep_attn(layer: int):
        def hook(before: Tensor, after: Tensor) -> Tensor:
            attn[layer] = (before.detach(), after.detach())
            return after

        return hook

    with ExitStack() as stack:
        z = stack.enter_context(model.sites.record((Site.z,)))
        for layer in graph.mlp_layers:
            stack.enter_context(mlp_output(model, graph, layer, keep(layer)))
        if graph.post_norm is not None:
            for layer in range(graph.n_layers):
                stack.enter_context(attn_output(model, layer, keep_attn(layer)))
        trace = model.trace(inputs)
    return Recording(trace, {layer: t.detach() for (_, layer), t in z.items()}, mlp, attn)


def head_outputs(model: HookedModel, layer: int, z: Tensor) -> Tensor:
    """[head, n, pos, d_model]: each head's z_h W_O[h] (its output into the residual stream, but on a
    post-norm model: head_senders)."""
    return torch.einsum("bphd,hdm->hbpm", z, model.sites.W_O(layer).to(z.dtype))


def head_senders(
    model: HookedModel, graph: EdgeGraph, layer: int, z: Tensor, attn: tuple[Tensor, Tensor] | None
) -> Tensor:
    """[head, n, pos, d_model]: the heads' sender outputs; `attn`, the layer's (A, normalised A) in the
    same run, is read under shares."""
    heads = head_outputs(model, layer, z)
    if graph.post_norm != "shares":
        return heads
    assert attn is not None
    return shares(attn_norm(model, layer), *attn, heads, model.norm_offset)


def sender_outputs(model: HookedModel, graph: EdgeGraph, rec: Recording) -> Tensor:
    """[senders, n, pos, d_model] in the graph's sender order."""
    parts = [rec.trace.resid_pre[0].detach().unsqueeze(0)]
    for layer in range(graph.n_layers):
        parts.append(head_senders(model, graph, layer, rec.z[layer], rec.attn.get(layer)))
        if layer in graph.mlp_layers:
            parts.append(rec.mlp[layer].unsqueeze(0))
    return torch.cat(parts)


def patch_deltas(model: HookedModel, graph: EdgeGraph, clean: Recording, corrupt_out: Tensor) -> Tensor:
    """[senders, n, pos, d_model]: what each sender's edge, patched alone, adds to its receiver's clean
    input: out(corrupt) - out(clean), but under mib a head's goes through its layer's norm on the clean A."""
    delta = corrupt_out - sender_outputs(model, graph, clean)
    if graph.post_norm == "mib":
        for layer in range(graph.n_layers):
            rows = graph.head_rows(layer)
            delta[rows] = renormed(model, layer, clean.attn[layer], delta[rows])
    return delta


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
    """The task's smooth quantity per prompt [n] (per copy [copies, n] for a stacked batch); from the
    vocabulary rows it reads alone where the task names them (Task.vocab_rows)."""
    copies = resid_final.shape[0] // data.n
    positions = data.positions.repeat(copies, 1)
    at_rows = rows_quantities(model, task, resid_final, positions, data, [column], CHUNK_MB)
    if at_rows is None:
        logits = model.readout(resid_final, positions)
        values = task.per_prompt(logits.unflatten(0, (copies, data.n)), data)[..., column]
    else:
        values = at_rows[..., 0]
    return values if copies > 1 else values[0]
