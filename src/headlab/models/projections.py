"""The q, k and v projections of one head alone: while a receiver's copy of the stream needs its own
head's query, key or value (edges/evaluate.py), its projection computes that head's columns and nothing
else. Which columns hold a head is read from the sites' own split of the projections' outputs
(HeadSites.qkv_split on column numbers), so every family's layout (separate, GPT-2's side by side,
GPT-NeoX's interleaved) is its row's. Exact for that head: nothing between the projections and the q, k, v
sites mixes heads (HeadSites.qkv_projs).

Where q, k and v each have a projection of their own (Llama, Qwen, Gemma, OLMo), each projection's output is
one head wide, the wanted head's columns on its copy: the family's attention views it as one head
(transformers' `view(*input_shape, -1, head_dim)`), so rotary embeddings and q/k norms run on that head
alone, not on every head's zeros. A fused projection (GPT-2's c_attn, GPT-NeoX's query_key_value) is split
at fixed widths: there every column is kept, the others' zero."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..vocabulary import Site
from .sites import HeadSites


@contextmanager
def heads_alone(sites: HeadSites, layer: int, wanted: list[tuple[str, int]], n: int) -> Iterator[None]:
    """Layer's q/k/v projection modules, while inside, compute for stacked copy c (of n rows) only
    the columns of head wanted[c] (site, head), the rest zero (a nn.Linear or GPT-2's Conv1D; where
    another kind of module projects, every column). Separate q, k and v projections give one head's
    width, the wanted head's on its copy (zero where the copy wants another projection's head)."""
    projs = sites.qkv_projs[layer] if sites.qkv_projs is not None else []
    columns = head_columns(sites, layer)
    if not projs or columns is None:
        yield
        return
    taken: dict[int, list[tuple[int, Tensor]]] = {}
    for copy, (site, head) in enumerate(wanted):
        which, cols = columns[(site, head)]
        taken.setdefault(which, []).append((copy, cols))
    saved = []
    one_head = len(projs) == 3  # q, k and v each projected alone: nothing splits the output at fixed widths
    for i, module in enumerate(projs):
        weight = _out_in(module)
        assert weight is not None  # head_columns read every projection's weight
        saved.append((module, module.__dict__.get("forward")))
        module.__dict__["forward"] = _selected(weight, getattr(module, "bias", None), taken.get(i, []), n, one_head)
    try:
        yield
    finally:
        for module, own in saved:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = own


def head_columns(sites: HeadSites, layer: int) -> dict[tuple[str, int], tuple[int, Tensor]] | None:
    """(site, head) -> (which projection module, its output columns holding that head), read from the
    sites' own split of the projections' outputs (qkv_split on column numbers); None where a projection
    is no nn.Linear or Conv1D."""
    if sites.qkv_projs is None or sites.qkv_split is None:
        return None
    weights = [_out_in(m) for m in sites.qkv_projs[layer]]
    if any(w is None for w in weights):
        return None
    widths = [w.shape[0] for w in weights if w is not None]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    numbered = [torch.arange(w) + start for w, start in zip(widths, starts)]
    out: dict[tuple[str, int], tuple[int, Tensor]] = {}
    for site, per_head in zip((Site.q, Site.k, Site.v), sites.qkv_split(numbered)):  # [head, d_head] each
        for head, cols in enumerate(per_head):
            module = max(i for i, start in enumerate(starts) if start <= int(cols[0]))
            out[(site, head)] = (module, cols - starts[module])
    return out


def _out_in(module: nn.Module) -> Tensor | None:
    """A projection's weight as [out, in]: nn.Linear's as stored, GPT-2's Conv1D's transposed; None for
    another kind of module."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and isinstance(weight, Tensor):
        return weight
    if hasattr(module, "nf") and isinstance(weight, Tensor):  # transformers' Conv1D: weight [in, out]
        return weight.T
    return None


def _selected(
    weight: Tensor, bias: Tensor | None, taken: list[tuple[int, Tensor]], n: int, one_head: bool = False
) -> Callable:
    """A projection's forward over stacked copies of n rows that computes, for each (copy, columns) in
    `taken`, those output columns of that copy alone; every other output is zero. `one_head`: the output
    is those columns' width (one head), not the projection's."""
    copies_of = torch.tensor([c for c, _ in taken], dtype=torch.long)
    cols = torch.stack([cs for _, cs in taken]) if taken else torch.zeros(0, 0, dtype=torch.long)  # [k, width]

    def forward(x: Tensor) -> Tensor:
        width = cols.shape[1] if one_head and taken else weight.shape[0]
        out = x.new_zeros(*x.shape[:-1], width)
        if not taken:
            return out
        at, idx = copies_of.to(x.device), cols.to(x.device)
        rows = x.unflatten(0, (-1, n))[at]  # [k, n, pos, d]
        stacked = out.unflatten(0, (-1, n))  # [copies, n, pos, width]
        if one_head:
            y = torch.einsum("knpd,kcd->knpc", rows, weight[idx].to(x.dtype))  # [k, n, pos, width]
            if bias is not None:
                y = y + bias[idx].to(x.dtype)[:, None, None, :]
            stacked[at] = y
            return out
        y = torch.einsum("knpd,kcd->kcnp", rows, weight[idx].to(x.dtype))  # [k, width, n, pos]
        if bias is not None:
            y = y + bias[idx].to(x.dtype)[:, :, None, None]
        stacked[at[:, None], :, :, idx] = y  # advanced indices first: [k, width, n, pos]
        return out

    return forward
