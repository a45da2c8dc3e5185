"""Exact edge patching (the metric of a whole circuit: evaluate.py).

`exact_scores`: edge U -> R patched alone: R reads the clean residual stream plus U's activation
difference (out_U(corrupt) - out_U(clean)); every other reader reads clean values. All edges into one
layer run together as stacked copies of the prompts, started from the clean residual cached at that
layer (as the sweep engine does): the copy's attention reads the patched stream, and hooks keep every
query, key and value clean except the receiver's own; an MLP receiver's copy patches the MLP's input;
the logits' copies add the difference to the final residual.

On a post-norm model an edge's patch is postnorm.py's: record.patch_deltas.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch import Tensor

from ..interventions.edits import copy_bytes
from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .evaluate import clean_and_corrupted
from .graph import QKV, EdgeGraph
from .postnorm import attn_output, mlp_output
from .record import (
    check_pairs,
    metric,
    metric_column,
    patch_deltas,
    record,
    sender_outputs,
)

Hook = Callable[[Tensor], Tensor]


def exact_scores(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    which: Tensor | None = None,
    chunk_mb: float = 64.0,
    show_progress: bool = False,
) -> Tensor:
    """[senders, receivers] float64: the change in the mean metric when each edge (of `which`, default
    all) is patched alone; NaN elsewhere."""
    column = metric_column(task)
    which = graph.real if which is None else which & graph.real
    out = torch.full(graph.real.shape, float("nan"), dtype=torch.float64)
    with torch.inference_mode():
        runs = clean_and_corrupted(model, graph, data)
        clean = runs.clean
        delta = patch_deltas(model, graph, clean, runs.corrupt_out)
        trace = clean.trace
        base = metric(model, task, data, trace.resid_final, column)
        n = data.n
        # a copy holds two input differences and its residual stream (d_model wide) besides a block's
        # widest activation: three of the widest bound them all
        per_chunk = max(1, int(chunk_mb * 2**20 // (3 * copy_bytes(model, data))))
        groups = [(layer, which[:, graph.layer_receivers(layer)]) for layer in range(graph.n_layers)]
        logits = len(graph.receivers) - 1
        work = sum(int(w.sum()) for _, w in groups) + int(which[:, logits].sum())
        with progress_bar("exact edges", total=work, enabled=show_progress) as bar:
            done = 0
            senders = which[:, logits].nonzero().flatten().tolist()
            for start in range(0, len(senders), per_chunk):
                chunk = senders[start : start + per_chunk]
                h = trace.resid_final.repeat(len(chunk), 1, 1) + delta[chunk].flatten(0, 1)
                values = metric(model, task, data, h, column).view(len(chunk), n)
                out[chunk, logits] = (values - base).mean(1).double().cpu()
                done += len(chunk)
                bar.update(done)
            for layer, mask in groups:
                cols = graph.layer_receivers(layer)
                edges = mask.nonzero().tolist()
                for start in range(0, len(edges), per_chunk):
                    chunk = [(s, cols[r]) for s, r in edges[start : start + per_chunk]]
                    values = _patched_layer(model, task, data, graph, trace, layer, delta, chunk, column)
                    for (s, r), v in zip(chunk, values):
                        out[s, r] = float((v - base).mean())
                    done += len(chunk)
                    bar.update(done)
    return out


def _patched_layer(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    trace,
    layer: int,
    delta: Tensor,
    chunk: list[tuple[int, int]],
    column: int,
) -> Tensor:
    """[copies, n]: the metric with edge chunk[i] patched in copy i (every receiver in `layer`)."""
    n = data.n
    copies = len(chunk)
    x = trace.resid_pre[layer]
    kinds = [graph.receivers[r] for _, r in chunk]
    attn_delta = torch.zeros(copies, *x.shape, dtype=x.dtype, device=x.device)
    mlp_delta = torch.zeros_like(attn_delta)
    # ungrouped key/value edges under GQA (expands_kv): the attention gets k and v one copy per query head
    per_query = graph.expands_kv
    keep = {
        site: torch.zeros(copies, graph.n_heads if site == "q" or per_query else graph.n_kv_heads, dtype=torch.bool)
        for site in QKV
    }
    for c, ((s, _), r) in enumerate(zip(chunk, kinds)):
        if r.kind == "mlp":
            mlp_delta[c] = delta[s]
        else:
            attn_delta[c] = delta[s]
            keep[r.kind][c, r.head] = True
    clean_sites = _clean_qkv(model, trace, layer, x)
    repeat = {site: graph.group if per_query and site != "q" else 1 for site in QKV}
    fns: dict[str, Hook] = {
        site: _select(keep[site].to(x.device), clean_sites[site].repeat_interleave(repeat[site], 1), n, repeat[site])
        for site in QKV
    }
    has_mlp_edge = any(r.kind == "mlp" for r in kinds)
    with ExitStack() as stack:
        stack.enter_context(
            model.input_hooks(
                layer,
                attn_in=lambda t: t + attn_delta.flatten(0, 1),
                mlp_in=(lambda t: t + mlp_delta.flatten(0, 1)) if has_mlp_edge else None,
            )
        )
        stack.enter_context(model.hooks(layer, **fns))
        h = model.run_blocks(x.repeat(copies, 1, 1), layer, trace, copies=copies, read=data.positions.repeat(copies, 1))
    return metric(model, task, data, h, column).view(copies, n)


def _clean_qkv(model: HookedModel, trace, layer: int, x: Tensor) -> dict[str, Tensor]:
    with model.sites.record(QKV, [layer]) as kept:
        model.run_blocks(x, layer, trace, stop=layer + 1)
    return {site: kept[(site, layer)] for site in QKV}


def _select(keep: Tensor, clean: Tensor, n: int, repeat: int = 1) -> Hook:
    """A q/k/v hook over stacked copies: head j of copy c keeps its value where keep[c, j], else clean;
    `repeat`: each head of the site first handed over as that many copies (one per query head)."""

    def hook(t: Tensor) -> Tensor:
        stacked = t.repeat_interleave(repeat, 1).unflatten(0, (keep.shape[0], n))
        chosen = torch.where(keep.view(keep.shape[0], 1, -1, 1, 1), stacked, clean.unsqueeze(0))
        return chosen.flatten(0, 1)

    return hook


def exact_node_scores(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph) -> Tensor:
    """[senders] float64: the change in the mean metric when each node's output is patched from the
    corrupted run into every receiver at once (activation patching of the node): heads through z (on a
    post-norm model, their patch added to the layer's normalised output), MLPs through their output, the
    input node by the whole corrupted run."""
    check_pairs(data)
    column = metric_column(task)
    out = torch.full((len(graph.senders),), float("nan"), dtype=torch.float64)
    index = {s.name: i for i, s in enumerate(graph.senders)}
    with torch.inference_mode():
        clean = record(model, graph, data.inputs)
        corrupt = record(model, graph, data.counterfactual)  # type: ignore[arg-type]
        deltas = patch_deltas(model, graph, clean, sender_outputs(model, graph, corrupt)) if graph.post_norm else None
        trace, n = clean.trace, data.n
        base = metric(model, task, data, trace.resid_final, column)
        out[0] = float((metric(model, task, data, corrupt.trace.resid_final, column) - base).mean())
        for layer in range(graph.n_layers):
            has_mlp = layer in graph.mlp_layers
            copies = graph.n_heads + has_mlp

            def patch_z(t: Tensor, layer: int = layer) -> Tensor:
                stacked = t.unflatten(0, (-1, n)).clone()
                heads = torch.arange(graph.n_heads)
                stacked[heads, :, :, heads] = corrupt.z[layer].permute(2, 0, 1, 3)
                return stacked.flatten(0, 1)

            def patch_attn(_a: Tensor, out: Tensor, layer: int = layer) -> Tensor:
                stacked = out.unflatten(0, (-1, n)).clone()
                stacked[: graph.n_heads] += deltas[graph.head_rows(layer)]  # type: ignore[index]
                return stacked.flatten(0, 1)

            def patch_mlp(t: Tensor, layer: int = layer) -> Tensor:
                stacked = t.unflatten(0, (-1, n)).clone()
                stacked[-1] = corrupt.mlp[layer]
                return stacked.flatten(0, 1)

            with ExitStack() as stack:
                if graph.post_norm is None:
                    stack.enter_context(model.hooks(layer, z=patch_z))
                else:
                    stack.enter_context(attn_output(model, layer, patch_attn))
                if has_mlp:
                    stack.enter_context(mlp_output(model, graph, layer, patch_mlp))
                h = model.run_blocks(trace.resid_pre[layer].repeat(copies, 1, 1), layer, trace, copies=copies)
            values = (metric(model, task, data, h, column).view(copies, n) - base).mean(1).double().cpu()
            out[index[f"a{layer}.h0"] : index[f"a{layer}.h0"] + graph.n_heads] = values[: graph.n_heads]
            if has_mlp:
                out[index[f"m{layer}"]] = values[-1]
    return out
