"""Prompts of unequal length, each run only as far as it is read.

A batch of right-padded prompts runs every prompt to the longest one's last read position, yet in a causal
model a position after the last one a prompt's metric reads (or an edit touches) cannot change its
quantities. IOI's prompts need 14 to 20 tokens on smollm2 (16 prompts: 19% of the positions are past their
prompt's end), a user's prompt file as unequal as its lines. `buckets` splits the prompts, sorted by the
length each needs, into contiguous groups where the positions saved outweigh the cost of another pass
(BUCKET_COST), and the sweep runs each group cut to its own length: the same arithmetic on fewer positions,
each prompt's quantities unchanged (to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from jaxtyping import Int
from torch import Tensor

from ..tasks import Inputs, TaskData
from ..vocabulary import Site
from .plan import Intervention

# Another group costs a clean pass, a chunk per layer more and smaller products: worth it where it saves
# at least this share of the batch's positions (prompts x longest length)
BUCKET_COST = 0.05
MAX_BUCKETS = 8


def through(data: TaskData, length: int) -> TaskData:
    """The prompts through position length - 1: inputs, counterfactual and reference prompts alike."""
    seq_len = next(iter(data.inputs.values())).shape[1]
    if length >= seq_len:
        return data

    def cut(inputs: Inputs) -> Inputs:
        return {k: v[:, :length] if v.dim() >= 2 and v.shape[1] == seq_len else v for k, v in inputs.items()}

    return replace(
        data,
        inputs=cut(data.inputs),
        counterfactual=data.counterfactual and cut(data.counterfactual),
        reference=data.reference and cut(data.reference),
    )


def needed(data: TaskData, interventions: Sequence[Intervention]) -> Int[Tensor, " n"] | None:
    """[n]: how many first positions each prompt needs (through its last read position and every position
    an intervention names in it); None where lengths cannot be told apart: an edit of attention patterns
    (their key axis spans the whole batch) or a position counted from the end."""
    if any(e.site == Site.pattern for iv in interventions for e in iv.edits(1)):
        return None
    need = data.positions.max(1).values.cpu()
    roles = data.token_positions or {}
    for iv in interventions:
        if iv.token is not None and iv.token in roles:
            need = torch.maximum(need, roles[iv.token].cpu())
        elif iv.position is not None:
            if iv.position < 0:
                return None
            need = torch.maximum(need, torch.full_like(need, iv.position))
    return need + 1


def groups(data: TaskData, interventions: Sequence[Intervention]) -> list[tuple[Int[Tensor, " rows"], int]] | None:
    """buckets over what each prompt needs for these interventions (needed); None where one group is best
    or lengths cannot be told apart."""
    need = needed(data, interventions)
    return None if need is None else buckets(need)


def buckets(need: Int[Tensor, " n"]) -> list[tuple[Int[Tensor, " rows"], int]] | None:
    """The prompts' rows in contiguous groups by `need` (shortest first), each with its longest need, the
    length it runs through; None where one group is best."""
    order = torch.argsort(need, stable=True)
    lengths = need[order].tolist()
    n, longest = len(lengths), lengths[-1]
    cost = BUCKET_COST * n * longest
    # best[j]: the least positions (plus cost per group) for the first j prompts; ends at a change of length
    ends = [j for j in range(1, n + 1) if j == n or lengths[j] != lengths[j - 1]]
    best: dict[int, tuple[float, int, list[int]]] = {0: (0.0, 0, [])}
    for j in ends:
        options = []
        for i, (so_far, groups, cuts) in best.items():
            if i < j and groups < MAX_BUCKETS:
                options.append((so_far + (j - i) * lengths[j - 1] + cost, groups + 1, [*cuts, j]))
        best[j] = min(options, key=lambda o: o[0])
    _, groups, cuts = best[n]
    if groups == 1:
        return None
    starts = [0, *cuts[:-1]]
    return [(order[a:b], lengths[b - 1]) for a, b in zip(starts, cuts)]


def bucket(data: TaskData, rows: Int[Tensor, " rows"], length: int) -> TaskData:
    """The prompts `rows` (TaskData.take) through position length - 1."""
    return through(data.take(rows.to(data.positions.device)), length)


def parts(data: TaskData) -> list[tuple[Int[Tensor, " rows"], TaskData]]:
    """(rows, those prompts through the positions they read) for each group of prompts of like length, or
    every prompt as it is where one group is best: for code that runs whole prompts (the circuit metric)."""
    reads = [data.positions, *(data.counterfactual_positions or {}).values()]
    need = torch.stack([r.reshape(data.n, -1).max(1).values.cpu() for r in reads]).max(0).values + 1
    grouped = buckets(need)
    if grouped is None:
        return [(torch.arange(data.n), data)]
    return [(rows, bucket(data, rows, length)) for rows, length in grouped]


def passes(data: TaskData, prompts_per_pass: int) -> list[TaskData]:
    """The prompts `prompts_per_pass` at a time, each pass's in its groups of like length (parts): a run of
    whole prompts in passes, as EAP scores them (edges/eap.py) and flops.circuit_gflop counts them."""
    return [
        part for s in range(0, data.n, prompts_per_pass) for _, part in parts(data.take(slice(s, s + prompts_per_pass)))
    ]
