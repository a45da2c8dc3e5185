"""EAP and EAP-IG scores in the model a rival circuit must do without: every forbidden edge U -> R carries
out_U(corrupt) whatever the run (the found circuit's edges, or every edge out of its heads), the rest as
the model computes them. The rival search of edges/audit.py scores the units again in that model each
round (forbid the found circuit's edges, score again, build the best circuit from the rest): an edge that
matters only beside a forbidden one scores low there, and one that takes over a forbidden edge's work
scores high.

An allowed edge's score is eap.py's, (out_U(corrupt) - out_U(clean)) . dm/d in_R, taken in that model:
out_U(clean) is U's output in its clean run, and the gradient is at R's own input in its clean run (eap) or
averaged over runs whose input is corrupt + alpha * (clean - corrupt), alpha = k/steps (eap_ig; k from
eap.first_k, hannamw/EAP-IG's k = 0..steps-1 by default). The forward pass is evaluate.py's circuit pass
(each receiver reading the stream plus its cut senders' differences), run under autograd: the whole pass is
held for the backward, so memory grows with `prompts_per_pass` (a few prompts at a time; the scores are
sums over prompts). With nothing forbidden the scores are eap.scores'; with edges forbidden they equal
autograd on tests/edge_reference.py's hand-built split forward with those edges cut
(tests/test_edges.py, tests/test_edges_postnorm.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UsageError
from ..interventions.lengths import passes as prompt_passes
from ..models.hooked import HookedModel
from ..progress import progress_bar
from ..tasks import Task, TaskData
from .eap import first_k
from .evaluate import Runs, circuit_forward, clean_and_corrupted
from .graph import EdgeGraph
from .record import metric, metric_column

RESCORED = ("eap", "eap_ig")


def scores(
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    forbidden: Tensor,
    method: str = "eap_ig",
    steps: int = 5,
    prompts_per_pass: int = 4,
    show_progress: bool = False,
    ig_steps_from: int | None = None,
) -> Tensor:
    """[senders, receivers] float64: each allowed edge's score in the model whose `forbidden` edges
    ([senders, receivers] bool) carry the corrupted run's values (NaN there and where there is no edge)."""
    if method not in RESCORED:
        raise UsageError(f"scores with edges forbidden: {method} cannot; choose from {', '.join(RESCORED)}")
    first = first_k(method, ig_steps_from)
    alphas = [1.0] if method == "eap" else [k / steps for k in range(first, first + steps)]
    forbidden = forbidden.cpu() & graph.real
    kept = graph.real & ~forbidden
    column = metric_column(task)
    total = torch.zeros(graph.real.shape, dtype=torch.float64)
    passes = prompt_passes(data, prompts_per_pass)
    with progress_bar(f"edges ({method}, forbidden)", total=len(passes), enabled=show_progress) as bar:
        for i, part in enumerate(passes):
            runs = clean_and_corrupted(model, graph, part, for_grad=True)
            with torch.no_grad():  # the senders' differences in this model's clean run
                _, diff = circuit_forward(model, graph, runs, kept, 0, runs.clean.trace.resid_pre[0])
                delta = diff.flatten(1).clone()  # [senders, n * pos * d]; the next pass reuses diff's buffer
            for alpha in alphas:
                _add_gradients(total, model, task, part, graph, runs, kept, delta, column, alpha)
            bar.update(i + 1)
    total /= data.n * len(alphas)
    return total.masked_fill(~graph.real | forbidden, float("nan"))


def _add_gradients(
    total: Tensor,
    model: HookedModel,
    task: Task,
    data: TaskData,
    graph: EdgeGraph,
    runs: Runs,
    kept: Tensor,
    delta: Tensor,
    column: int,
    alpha: float,
) -> None:
    """Add delta . dm/d in_R of one run (input at `alpha`) to total, for every receiver R."""
    clean_in, corrupt_in = runs.clean.trace.resid_pre[0], runs.corrupt_resid[0]
    # a leaf needing grad, so that every receiver's input (all read the input node) is in the graph
    given = (corrupt_in + alpha * (clean_in - corrupt_in)).requires_grad_()
    runs.scratch = None  # a buffer of its own: the last pass's, written in place, would chain onto its graph
    read: list[tuple[list[int], Tensor]] = []
    with torch.enable_grad():
        final, _ = circuit_forward(model, graph, runs, kept, 0, given, given, lambda c, x: read.append((c, x)))
        value = metric(model, task, data, final, column).sum()
        grads = torch.autograd.grad(value, [x for _, x in read], allow_unused=True)
    for (cols, _), grad in zip(read, grads):
        if grad is not None:  # None: nothing the metric reads depends on these receivers
            total[:, cols] += (delta @ grad.reshape(len(cols), -1).to(delta.dtype).T).double().cpu()
