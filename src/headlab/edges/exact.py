"""Exact edge patching, and the metric of a circuit.

`exact_scores`: edge U -> R patched alone: R reads the clean residual stream plus U's activation
difference (out_U(corrupt) - out_U(clean)); every other reader reads clean values. All edges into one
layer run together as stacked copies of the prompts, started from the clean residual cached at that
layer (as the sweep engine does): the copy's attention reads the patched stream, and hooks keep every
query, key and value clean except the receiver's own; an MLP receiver's copy patches the MLP's input;
the logits' copies add the difference to the final residual.

`circuit_metric`: every edge outside the circuit patched at once (EAP-IG's evaluate_graph): each
receiver reads the current residual stream plus, for each sender whose edge into it is not in the
circuit, out_U(corrupt) - out_U(current run). Each layer runs one copy per attention receiver (its own
input), and each head takes its query from its q copy and its key and value from its kv head's copies.

On a post-norm model an edge's patch is postnorm.py's: record.patch_deltas for one edge, and under mib
the cut heads of one layer pass through its norm together into each receiver (postnorm.received).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor

from ..interventions.edits import copy_bytes
from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .graph import QKV, EdgeGraph
from .postnorm import attn_output, mlp_output, received
from .record import (
    Recording,
    check_pairs,
    head_senders,
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
    keep = {
        site: torch.zeros(copies, graph.n_heads if site == "q" else graph.n_kv_heads, dtype=torch.bool) for site in QKV
    }
    for c, ((s, _), r) in enumerate(zip(chunk, kinds)):
        if r.kind == "mlp":
            mlp_delta[c] = delta[s]
        else:
            attn_delta[c] = delta[s]
            keep[r.kind][c, r.head] = True
    clean_sites = _clean_qkv(model, trace, layer, x)
    fns: dict[str, Hook] = {site: _select(keep[site].to(x.device), clean_sites[site], n) for site in QKV}
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


def _select(keep: Tensor, clean: Tensor, n: int) -> Hook:
    """A q/k/v hook over stacked copies: head j of copy c keeps its value where keep[c, j], else clean."""

    def hook(t: Tensor) -> Tensor:
        stacked = t.unflatten(0, (keep.shape[0], n))
        chosen = torch.where(keep.view(keep.shape[0], 1, -1, 1, 1), stacked, clean.unsqueeze(0))
        return chosen.flatten(0, 1)

    return hook


@dataclass
class Runs:
    """The clean recording and what circuit_metric reads of the corrupted run: every sender's output
    [senders, n, pos, d], each block's input and the last one's output, and (post-norm models) each
    layer's attention output A before its norm."""

    clean: Recording
    corrupt_out: Tensor
    corrupt_resid: list[Tensor]
    corrupt_attn: dict[int, Tensor]


def clean_and_corrupted(model: HookedModel, graph: EdgeGraph, data: TaskData) -> Runs:
    check_pairs(data)
    with torch.inference_mode():
        clean = record(model, graph, data.inputs)
        corrupt = record(model, graph, data.counterfactual)  # type: ignore[arg-type]
        resid = [*corrupt.trace.resid_pre, corrupt.trace.resid_final]
        return Runs(clean, sender_outputs(model, graph, corrupt), resid, {l: a for l, (a, _) in corrupt.attn.items()})


def circuit_metric(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    circuit: Tensor,
    runs: Runs | None = None,
) -> Tensor:
    """[n]: the metric per prompt with every edge outside `circuit` ([senders, receivers] bool) patched
    from the corrupted run. `runs`: clean_and_corrupted's, where several circuits are measured on the same
    prompts.

    Below the first layer with an edge of the circuit into it every receiver reads the corrupted run, so
    the pass starts there from the corrupted run's residual stream (with the clean input node, which the
    stream itself carries): the same values as running those layers, to float rounding."""
    column = metric_column(task)
    with torch.inference_mode():
        runs = runs or clean_and_corrupted(model, graph, data)
        trace, corrupt_out = runs.clean.trace, runs.corrupt_out
        kept = circuit.cpu() & graph.real
        cut = (graph.real & ~kept).to(corrupt_out.device, corrupt_out.dtype)  # [senders, receivers]
        into = kept.any(0).nonzero().flatten().tolist()
        first = min((graph.receivers[r].layer for r in into), default=graph.n_layers)
        below = graph.head_rows(first).start if first < graph.n_layers else len(graph.senders)
        current = torch.zeros_like(corrupt_out)
        current[0] = trace.resid_pre[0]
        current[1:below] = corrupt_out[1:below]
        # post-norm models: each layer's A in this run
        before: dict[int, Tensor] = {l: a for l, a in runs.corrupt_attn.items() if l < first}
        h = runs.corrupt_resid[first] + (trace.resid_pre[0] - runs.corrupt_resid[0])
        for layer in range(first, graph.n_layers):
            h = _circuit_layer(model, graph, trace, layer, h, corrupt_out, current, cut, before)
        final = h + received(model, graph, cut[:, -1:], corrupt_out - current, before)[0]  # the logits
        return metric(model, task, data, final, column)


def _circuit_layer(
    model: HookedModel,
    graph: EdgeGraph,
    trace,
    layer: int,
    h: Tensor,
    corrupt_out: Tensor,
    current: Tensor,
    cut: Tensor,
    before: dict[int, Tensor],
) -> Tensor:
    """Block `layer` with each receiver reading its own input; fills in current[] for its senders.

    A head with no edge out of it in the circuit needs no input of its own: every reader of its output
    gets its corrupted output instead (the current one cancels). The q/k/v receivers of the other heads
    each get a copy of the stream as far as its own head's q, k or v (HookedModel.attention_inputs: the
    copies stop there, and each projects its head's columns alone); the block then runs once, each head
    taking its query from its q copy and its key and value from its kv head's copies, the MLP reading its
    own input."""
    cols = graph.layer_receivers(layer)
    attn_cols = [c for c in cols if graph.receivers[c].kind != "mlp"]
    heads = graph.head_rows(layer)
    live = (graph.real[heads] & (cut[heads] == 0).cpu()).any(1)  # heads with an edge out in the circuit
    owned = graph.owners()[heads]
    kept = [c for c in attn_cols if (owned[:, c] & live).any()] or attn_cols[:1]
    copy_of = {c: i for i, c in enumerate(kept)}
    copies, n = len(kept), h.shape[0]
    deltas = received(model, graph, cut[:, kept], corrupt_out - current, before)  # [copies, n, pos, d]
    stacked = [
        t.unflatten(0, (copies, n))  # [copies, n, head, pos, d_head]
        for t in model.attention_inputs(
            h.repeat(copies, 1, 1),
            layer,
            trace,
            copies,
            attn_in=lambda t: t + deltas.flatten(0, 1),
            wanted=[(graph.receivers[c].kind, graph.receivers[c].head) for c in kept],  # type: ignore[misc]
        )
    ]
    assembled = {}
    for kind, t in zip(QKV, stacked):
        sources = torch.tensor([copy_of.get(c, 0) for c in attn_cols if graph.receivers[c].kind == kind])
        picked = t[sources.to(t.device), :, torch.arange(t.shape[2], device=t.device)]  # [head, n, pos, d_head]
        assembled[kind] = picked.transpose(0, 1)
    z_now: list[Tensor] = []
    attn_now: list[tuple[Tensor, Tensor]] = []

    def keep_z(t: Tensor) -> Tensor:
        z_now.append(t)
        return t

    def keep_attn(a: Tensor, out: Tensor) -> Tensor:
        attn_now.append((a, out))
        before[layer] = a
        return out

    def heads_now() -> Tensor:
        return head_senders(model, graph, layer, z_now[0], attn_now[0] if attn_now else None)

    def mlp_input(t: Tensor) -> Tensor:
        current[heads] = heads_now()
        mlp_col = next(c for c in cols if graph.receivers[c].kind == "mlp")
        return t + received(model, graph, cut[:, [mlp_col]], corrupt_out - current, before)[0]

    def keep_mlp(t: Tensor) -> Tensor:
        current[heads.stop] = t  # the MLP follows its layer's heads
        return t

    has_mlp = layer in graph.mlp_layers

    def given(kind: str) -> Hook:
        return lambda _t: assembled[kind]

    fns: dict[str, Hook] = {kind: given(kind) for kind in QKV}
    fns["z"] = keep_z
    with ExitStack() as stack:
        stack.enter_context(model.input_hooks(layer, mlp_in=mlp_input if has_mlp else None))
        stack.enter_context(model.hooks(layer, **fns))
        if has_mlp:
            stack.enter_context(mlp_output(model, graph, layer, keep_mlp))
        if graph.post_norm is not None:
            stack.enter_context(attn_output(model, layer, keep_attn))
        out = model.run_blocks(h, layer, trace, stop=layer + 1)
    current[heads] = heads_now()
    return out


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
