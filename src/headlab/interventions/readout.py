"""Task quantities of a sweep's stacked batches: logits at the read positions only, a bounded number of
copies at a time.

Where the task reads its quantities from a few rows of the vocabulary (Task.vocab_rows: a logit difference,
a probability or a loss with the softmax's normaliser), a readout unembeds those rows alone and, where the
task needs it, the normaliser a slice of the vocabulary at a time (HookedModel.readout_normaliser): no
position's whole logits are held, and NORMALISED_ROWS positions share each slice's read of the unembedding.

Else a readout multiplies by the whole unembedding (vocabulary x d_model: 154 MB for GPT-2 in float32, 113 MB
for smollm2), which is read from memory however few rows it has. For a chunk of a few copies of a few prompts
that read costs more than the arithmetic, so `Readouts` keeps each chunk's last hidden states at the read
positions (d_model numbers a position, where the logits are vocabulary) and reads them out together,
READOUT_ROWS rows at a time on a CPU, where `chunk_mb` holds their logits (on a GPU, as many as it holds).
Where one copy's logits (prompts x read positions x vocabulary) do not fit in `chunk_mb`, its prompts are read
out a slice at a time (`in_slices`), one prompt at least: a task's quantities are per prompt, so the slices'
quantities are the whole copy's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..models.hooked import VOCAB_SLICE, HookedModel
from ..tasks import Task, TaskData

# Rows (prompts x positions) a readout gathers on a CPU, where the budget allows: reading the unembedding
# costs about as much as 50 rows' arithmetic there (~170 GFLOP/s against ~7 GB/s); more rows would mostly
# hold more logits at once. A GPU gathers as many as its budget holds: there each readout's cost is its
# kernel launches.
READOUT_ROWS = 64
# Logits held at once by a readout given no budget of its own (engine.chunk_mb's default)
CHUNK_MB = 32.0
# Positions one readout_normaliser takes at once on a CPU, across copies: each slice of the unembedding is
# read from memory once for them all (~130 GFLOP/s at 64 positions on smollm2, ~185 at 1024)
NORMALISED_ROWS = 1024


def copies_per_readout(model: HookedModel, data: TaskData, positions: int, h: Tensor, chunk_mb: float) -> int:
    """How many copies go through one readout of hidden states like `h`: READOUT_ROWS rows' worth on a CPU,
    as far as their logits (prompts x `positions` x vocabulary) fit in `chunk_mb`; one at least."""
    rows = data.n * positions
    fit = int(chunk_mb * 2**20 // (rows * model.vocab_size * h.element_size()))
    return max(1, fit if h.device.type == "cuda" else min(fit, -(-READOUT_ROWS // rows)))


def prompts_per_readout(model: HookedModel, positions: int, h: Tensor, chunk_mb: float) -> int:
    """How many prompts' logits (`positions` x vocabulary each, in h's dtype) fit in `chunk_mb`; one at least."""
    return max(1, int(chunk_mb * 2**20 // (positions * model.vocab_size * h.element_size())))


def in_slices(
    model: HookedModel,
    h: Float[Tensor, "rows pos d_model"],
    read: Int[Tensor, "rows P"],
    chunk_mb: float,
    fn: Callable[[slice, Tensor], Tensor],
) -> Tensor:
    """fn(rows, logits [rows, P, vocab]) over the logits of hidden states h [m, pos, d] at `read` [m, P], a slice
    of rows at a time with at most `chunk_mb` of logits each (one row at least, all of its P positions); the
    results joined along their first dimension."""
    step = prompts_per_readout(model, read.shape[1], h, chunk_mb)
    parts: list[Tensor] = []
    for first in range(0, h.shape[0], step):
        rows = slice(first, first + step)
        logits = model.readout(h[rows], read[rows])
        parts.append(fn(rows, logits))
        del logits  # before the next slice's are made
    return torch.cat(parts)


def rows_quantities(
    model: HookedModel,
    task: Task,
    h: Float[Tensor, "rows pos d_model"],
    read: Int[Tensor, "rows P"],
    data: TaskData,
    columns: Sequence[int],
    chunk_mb: float,
) -> Float[Tensor, "copies n C"] | None:
    """The quantities `columns` [copies, n, C] of a stacked batch h [copies*n, pos, d] read at `read`
    [copies*n, P] from the vocabulary rows the task names (Task.vocab_rows) and, where it needs it, the
    normaliser (its vocabulary slices' logits at most `chunk_mb` at once); None where the task needs whole
    logits. Differentiable: attribution patching's gradient goes back through it."""
    ids = task.vocab_rows(data, columns)
    if ids is None:
        return None
    n, copies = data.n, h.shape[0] // data.n
    rows = model.readout_rows(h, read, ids.repeat(copies, *[1] * (ids.dim() - 1))).unflatten(0, (copies, n))
    if not task.needs_normaliser(columns):  # a task of its own may define from_rows without the normaliser
        return task.from_rows(rows, data, columns)
    at_once = int(chunk_mb * 2**20 // (VOCAB_SLICE * max(4, h.element_size())))
    normaliser = model.readout_normaliser(h, read, at_once).unflatten(0, (copies, n))
    return task.from_rows(rows, data, columns, normaliser)


def read_quantities(
    model: HookedModel,
    task: Task,
    h: Float[Tensor, "rows pos d_model"],
    read: Int[Tensor, "rows P"],
    data: TaskData,
    chunk_mb: float,
) -> Float[Tensor, "copies n Q"]:
    """Task quantities [copies, n, Q] of a stacked batch h [copies*n, pos, d] read at `read` [copies*n, P]:
    where the task reads its quantities from a few rows of the vocabulary, from those (rows_quantities);
    else the logits of as many copies as fit in `chunk_mb` at a time; where one copy's do not fit, that
    copy's prompts a slice at a time (in_slices), their quantities joined."""
    n, copies = data.n, h.shape[0] // data.n
    from_rows = rows_quantities(model, task, h, read, data, range(len(task.quantities)), chunk_mb)
    if from_rows is not None:
        return from_rows
    step = copies_per_readout(model, data, read.shape[1], h, chunk_mb)
    parts: list[Tensor] = []
    one_prompt_mb = read.shape[1] * model.vocab_size * h.element_size() / 2**20
    if prompts_per_readout(model, read.shape[1], h, chunk_mb) < n or one_prompt_mb > chunk_mb:  # slices
        for first in range(0, copies * n, n):
            copy = slice(first, first + n)
            quantities = in_slices(
                model, h[copy], read[copy], chunk_mb, lambda rows, logits: task.per_prompt(logits, data.take(rows))
            )
            parts.append(quantities[None])
        return torch.cat(parts)
    for first in range(0, copies, step):
        rows = slice(first * n, (first + step) * n)
        logits = model.readout(h[rows], read[rows]).unflatten(0, (-1, n))
        parts.append(task.per_prompt(logits, data))
        del logits  # else the next readout is made while this one is still held: twice the memory
    return torch.cat(parts)


class Readouts:
    """Collects chunks' hidden states at their read positions (`add`) and reads them out in whole readouts of
    `chunk_mb` of logits as they fill (the rest at `flush`); `results` maps each intervention's index to its
    quantities [n, Q]."""

    def __init__(self, model: HookedModel, task: Task, data: TaskData, chunk_mb: float):
        self.model, self.task, self.data, self.chunk_mb = model, task, data, chunk_mb
        self.results: dict[int, Tensor] = {}
        # a task read from vocabulary rows holds no logits: NORMALISED_ROWS positions share a readout
        self.by_rows = task.vocab_rows(data, range(len(task.quantities))) is not None
        self._indices: list[int] = []
        self._hidden: list[Tensor] = []

    def add(self, indices: Sequence[int], h: Float[Tensor, "rows pos d_model"], read: Int[Tensor, "rows P"]) -> None:
        """Copy j of the stacked batch h [copies*n, pos, d] is intervention indices[j]; `read` [copies*n, P]."""
        rows = torch.arange(h.shape[0], device=h.device).unsqueeze(1)
        self._hidden.append(h[rows, read.to(h.device)])
        self._indices += indices
        self._read_out(everything=False)

    def flush(self) -> None:
        """Read out every copy still held."""
        self._read_out(everything=True)

    def _read_out(self, everything: bool) -> None:
        """Whole readouts of what is held (all of it, if `everything`); the rest waits for more copies."""
        if not self._indices:
            return
        hidden = torch.cat(self._hidden) if len(self._hidden) > 1 else self._hidden[0]
        n, positions = self.data.n, hidden.shape[1]
        if self.by_rows:
            step = max(1, NORMALISED_ROWS // (n * positions))
        else:
            step = copies_per_readout(self.model, self.data, positions, hidden, self.chunk_mb)
        ready = len(self._indices) if everything else len(self._indices) // step * step
        if ready:
            read = torch.arange(positions, device=hidden.device).expand(ready * n, -1)
            quantities = read_quantities(self.model, self.task, hidden[: ready * n], read, self.data, self.chunk_mb)
            self.results.update(zip(self._indices[:ready], quantities))
        self._indices, self._hidden = self._indices[ready:], [hidden[ready * n :]]
