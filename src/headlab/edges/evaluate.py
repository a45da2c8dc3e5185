"""The metric of a circuit: every edge outside it patched from the corrupted run at once (EAP-IG's
evaluate_graph, hannamw/EAP-IG src/eap/evaluate.py).

Each receiver reads the current residual stream plus, for each sender whose edge into it is not in the
circuit, out_U(corrupt) - out_U(current run). Each layer gives each q/k/v receiver a copy of the stream as
far as its own head's q, k or v (HookedModel.attention_inputs), then runs once on the assembled q, k and v;
its MLP reads its own input. tests/test_edges.py holds it to a hand-patched transformers forward
(test_circuit_metric_equals_the_reference_on_a_partial_circuit), in float64 to 1e-10.

What is shared between circuits is computed once, and what a receiver reads costs what its circuit's
edges into it cost (Patches): the senders' differences are kept and updated row by row as the run
computes each sender (not recomputed per receiver), and a receiver with more cut edges than kept ones
reads the sum of every upstream sender's difference (kept running as rows are filled) less its kept
edges'. On a post-norm model under mib the cut heads of one layer pass through its norm together
(postnorm.received).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.hooked import HookedModel, Trace
from ..models.projections import heads_alone
from ..tasks import Task, TaskData
from .graph import QKV, EdgeGraph
from .postnorm import attn_output, mlp_output, received, renormed
from .record import Recording, check_pairs, head_senders, metric, metric_column, record, sender_outputs

Hook = Callable[[Tensor], Tensor]


@dataclass
class Runs:
    """The clean recording and what circuit_metric reads of the corrupted run: every sender's output
    [senders, n, pos, d], each block's input and the last one's output, and (post-norm models) each
    layer's attention output A before its norm."""

    clean: Recording
    corrupt_out: Tensor
    corrupt_resid: list[Tensor]
    corrupt_attn: dict[int, tuple[Tensor, Tensor]]  # layer -> (A, its norm's output)
    scratch: Tensor | None = None  # the senders' differences of the circuit measured now (Patches.diff)


def clean_and_corrupted(model: HookedModel, graph: EdgeGraph, data: TaskData, for_grad: bool = False) -> Runs:
    """`for_grad`: recorded under no_grad, not inference_mode, so that a pass under autograd may save them."""
    check_pairs(data)
    with torch.no_grad() if for_grad else torch.inference_mode():
        clean = record(model, graph, data.inputs)
        corrupt = record(model, graph, data.counterfactual)  # type: ignore[arg-type]
        resid = [*corrupt.trace.resid_pre, corrupt.trace.resid_final]
        return Runs(clean, sender_outputs(model, graph, corrupt), resid, dict(corrupt.attn))


class Patches:
    """What receivers read beyond this run's residual stream: for receiver r, the sum over the senders s
    cut from it of diff[s] = out_s(corrupt) - out_s(this run), as the run fills in its senders' outputs."""

    def __init__(
        self, model: HookedModel, graph: EdgeGraph, runs: Runs, kept: Tensor, first: int, given: Tensor | None = None
    ):
        """`kept` [senders, receivers] bool: the circuit's edges; the run starts at layer `first`, every
        sender before it at its corrupted output (the input node: the clean one, or `given`)."""
        self.model, self.graph, self.runs = model, graph, runs
        corrupt = runs.corrupt_out
        self.kept = kept.to(corrupt.device)
        self.cut = graph.real.to(corrupt.device) & ~self.kept
        # rows from layer `first` on are written (set) before anything reads them: only those below are zeroed
        if runs.scratch is None or runs.scratch.shape != corrupt.shape:
            runs.scratch = torch.empty_like(corrupt)
        self.diff = runs.scratch
        below = graph.head_rows(first).start if first < graph.n_layers else len(graph.senders)
        self.diff[1:below] = 0
        self.diff[0] = corrupt[0] - (runs.clean.trace.resid_pre[0] if given is None else given)
        self.total = self.diff[0].clone()  # the sum of diff over rows < self.summed
        self.summed = 1
        self.reads = graph.real.sum(0)  # each receiver reads a prefix of the senders: this many
        # post-norm models under mib: each layer's attention output A in this run and its norm's output (the
        # corrupted run's below first)
        self.before: dict[int, tuple[Tensor, Tensor]] = {l: a for l, a in runs.corrupt_attn.items() if l < first}

    def set(self, rows: slice | int, outputs: Tensor) -> None:
        """The run's outputs of the senders `rows` (their differences follow)."""
        self.diff[rows] = self.runs.corrupt_out[rows] - outputs

    def into(self, cols: list[int], upto: int | None = None) -> Tensor:
        """[k, n, pos, d]: what receivers `cols` read beyond this run's residual stream, from the first
        `upto` senders at most (None: all they read)."""
        reads = [int(self.reads[c]) if upto is None else min(int(self.reads[c]), upto) for c in cols]
        if self.graph.post_norm == "mib":
            # the rows past the prefix the receivers read are not written yet (any value, NaN included)
            count = max(reads)
            cut = self.cut[:count, cols].to(self.diff.dtype)
            return received(self.model, self.graph, cut, self.diff[:count], self.before)
        groups: dict[int, list[int]] = {}  # receivers by how many senders they read (a layer's heads: one group)
        for i, count in enumerate(reads):
            groups.setdefault(count, []).append(i)
        parts = [(group, self._read_by([cols[i] for i in group], count)) for count, group in groups.items()]
        if len(parts) == 1:
            return parts[0][1]
        out = torch.empty(len(cols), *self.diff.shape[1:], dtype=self.diff.dtype, device=self.diff.device)
        for group, part in parts:
            out[group] = part
        return out

    def from_layer(self, col: int, layer: int) -> Tensor:
        """[n, pos, d]: what receiver `col` reads from the heads of `layer` alone, once they are set: into([col])
        is into([col], upto=their first row) plus this (each layer's cut heads act apart under mib too)."""
        rows = self.graph.head_rows(layer)
        cut = self.cut[rows, col].to(self.diff.dtype)  # [heads]
        part = torch.einsum("h,hnpd->npd", cut, self.diff[rows])
        if self.graph.post_norm != "mib" or not bool(cut.any()):
            return part
        return renormed(self.model, layer, self.before[layer], part)

    def _read_by(self, cols: list[int], count: int) -> Tensor:
        """[k, n, pos, d]: into(cols) for receivers that each read the first `count` senders."""
        kept, cut = self.kept[:count, cols], self.cut[:count, cols]
        # fewer kept edges than cut ones: the prefix sum less the kept; one product for both kinds, so
        # that the senders' differences (memory-bound here) are read once
        by_kept = kept.sum(0) < cut.sum(0)
        which = torch.where(by_kept, -kept.to(self.diff.dtype), cut.to(self.diff.dtype))  # [count, k]
        rows = which.ne(0).any(1).nonzero().flatten()
        # a gathered copy of the rows is written, then read by the product: the prefix as it is (a view) costs
        # less unless three times the rows are fewer than it
        if 3 * len(rows) > count:
            senders = self.diff[:count]
        else:
            which, senders = which[rows], self.diff[rows]
        part = torch.einsum("sk,snpd->knpd", which, senders)
        for i in by_kept.nonzero().flatten().tolist():  # in place: no gathered copy of those receivers
            part[i] += self.prefix(count)
        return part

    def prefix(self, count: int) -> Tensor:
        """The sum of diff over the first `count` senders (all of them filled in by now)."""
        if count > self.summed:
            self.total = self.total + self.diff[self.summed : count].sum(0)
            self.summed = count
        return self.total


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

    The whole graph is the clean run. Below the first layer with an edge of the circuit into it every
    receiver reads the corrupted run, so the pass starts there from the corrupted run's residual stream
    (with the clean input node, which the stream itself carries): the same values as running those
    layers, to float rounding."""
    column = metric_column(task)
    with torch.inference_mode():
        runs = runs or clean_and_corrupted(model, graph, data)
        kept = circuit.cpu() & graph.real
        if torch.equal(kept, graph.real):  # nothing cut: the clean run
            return metric(model, task, data, runs.clean.trace.resid_final, column)
        into = kept.any(0).nonzero().flatten().tolist()
        first = min((graph.receivers[r].layer for r in into), default=graph.n_layers)
        h = runs.corrupt_resid[first] + (runs.clean.trace.resid_pre[0] - runs.corrupt_resid[0])
        final, _ = circuit_forward(model, graph, runs, kept, first, h)
        return metric(model, task, data, final, column)


Read = Callable[[list[int], Tensor], None]


def circuit_forward(
    model: HookedModel,
    graph: EdgeGraph,
    runs: Runs,
    kept: Tensor,
    first: int,
    h: Tensor,
    given: Tensor | None = None,
    read: Read | None = None,
) -> tuple[Tensor, Tensor]:
    """(the stream the logits read [n, pos, d], the senders' differences out_U(corrupt) - out_U(this run)
    [senders, n, pos, d]) of the run with every edge outside `kept` patched, from block `first`'s input h.
    `given`: the input node's output in this run where it is not the clean one (EAP-IG's interpolation).
    `read(cols, x)` sees each receiver's own input as it is made: x [len(cols) * n, pos, d], receiver
    cols[i] in rows i * n .. (i + 1) * n (no column of a head whose every edge out is cut). Differentiable:
    under autograd the pass is held for a backward pass (edges/rescore.py)."""
    patches = Patches(model, graph, runs, kept, first, given)
    for layer in range(first, graph.n_layers):
        h = _circuit_layer(model, graph, runs.clean.trace, layer, h, patches, read)
    logits = len(graph.receivers) - 1
    final = h + patches.into([logits])[0]
    if read is not None:
        read([logits], final)
    return final, patches.diff


def _circuit_layer(
    model: HookedModel, graph: EdgeGraph, trace: Trace, layer: int, h: Tensor, patches: Patches, read: Read | None
) -> Tensor:
    """Block `layer` with each receiver reading its own input; fills in the patches' senders of the layer.

    A head with no edge out of it in the circuit needs no input of its own: every reader of its output gets its
    corrupted output instead (this run's cancels; under shares its value also sets the scale of the layer's
    norm, which every head's share reads, so there every head reads its own input). The q/k/v receivers of the
    other heads each get a copy of the stream as far as its own head's q, k or v, projected alone; the block
    then runs once, each head taking its query from its q copy and its key and value from its kv head's copies,
    the MLP reading its own input (ungrouped key/value edges under GQA: each query head its own key and value)."""
    cols = graph.layer_receivers(layer)
    attn_cols = [c for c in cols if graph.receivers[c].kind != "mlp"]
    heads = graph.head_rows(layer)
    live = (graph.real[heads] & ~patches.cut[heads].cpu()).any(1)  # heads with an edge out in the circuit
    if graph.post_norm == "shares":  # every head's value sets the norm's scale, which each head's share reads
        live[:] = True
    owned = graph.owners()[heads]
    live_cols = [c for c in attn_cols if (owned[:, c] & live).any()]
    kept = live_cols or attn_cols[:1]
    copy_of = {c: i for i, c in enumerate(kept)}
    copies, n = len(kept), h.shape[0]
    has_mlp = layer in graph.mlp_layers
    mlp = next(c for c in cols if graph.receivers[c].kind == "mlp") if has_mlp else None
    # the MLP's read of the senders below this layer's heads in the same product as the heads' q, k and v
    # (memory-bound: the senders' differences read once for both); its layer's own heads added once set
    read_now = patches.into(kept if mlp is None else [*kept, mlp], upto=heads.start)
    deltas = read_now[:copies]  # [copies, n, pos, d]
    stacked = [
        t.unflatten(0, (copies, n))  # [copies, n, head, pos, d_head]
        for t in model.attention_inputs(
            h.repeat(copies, 1, 1),
            layer,
            trace,
            copies,
            attn_in=lambda t: _seen(read if live_cols else None, kept, t + deltas.flatten(0, 1)),
            wanted=[(graph.receivers[c].kind, graph.site_head(graph.receivers[c])) for c in kept],
        )
    ]
    # each receiver's head of q, k or v from its own copy; ungrouped k and v: one per query head (expands_kv)
    assembled = {}
    for kind, t in zip(QKV, stacked):
        of_kind = [c for c in attn_cols if graph.receivers[c].kind == kind]
        sources = torch.tensor([copy_of.get(c, 0) for c in of_kind], device=t.device)
        site_heads = torch.tensor([graph.site_head(graph.receivers[c]) for c in of_kind], device=t.device)
        # one head a copy where the projections gave one head's width (models/projections.py), else every head
        assembled[kind] = t[sources, :, site_heads if t.shape[2] > 1 else 0].transpose(0, 1)  # [n, head, pos, d_head]
    z_now: list[Tensor] = []
    attn_now: list[tuple[Tensor, Tensor]] = []

    def keep_z(t: Tensor) -> Tensor:
        z_now.append(t)
        return t

    def keep_attn(a: Tensor, out: Tensor) -> Tensor:
        # the block's own call alone: under mib the MLP's input passes patched copies of A through this
        # norm too (postnorm.received)
        if not attn_now:
            attn_now.append((a, out))
            patches.before[layer] = (a, out)
        return out

    def heads_now() -> Tensor:
        return head_senders(model, graph, layer, z_now[0], attn_now[0] if attn_now else None)

    def mlp_input(t: Tensor) -> Tensor:
        assert mlp is not None
        patches.set(heads, heads_now())
        return _seen(read, [mlp], t + (read_now[copies] + patches.from_layer(mlp, layer)))

    def keep_mlp(t: Tensor) -> Tensor:
        patches.set(heads.stop, t)  # the MLP follows its layer's heads
        return t

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
        # the q, k and v hooks hand the attention the assembled ones: its own projections compute nothing
        stack.enter_context(heads_alone(model.sites, layer, [], h.shape[0]))
        out = model.run_blocks(h, layer, trace, stop=layer + 1)
    if not has_mlp:  # else the MLP's input hook set them
        patches.set(heads, heads_now())
    return out


def _seen(read: Read | None, cols: list[int], x: Tensor) -> Tensor:
    if read is not None:
        read(cols, x)
    return x
