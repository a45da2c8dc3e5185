"""One record per circuit method, as auto-circuit keeps a PruneAlgo per algorithm: how it scores edges and
nodes, the paper it follows, the original code it was read from, and the test that holds it to that code.
`study=circuit study.method=<name>` (`circuit=<name>`) runs the record of that name; register() adds one
from outside the package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UsageError
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from .eap import scores as attribution_scores
from .exact import exact_node_scores, exact_scores
from .graph import EdgeGraph
from .rescore import RESCORED
from .rescore import scores as forbidding_scores

# prompts a pass where scoring with edges forbidden: its pass is held whole for autograd's backward
FORBIDDING_PROMPTS = 8


@dataclass(frozen=True)
class Budget:
    """What a method may be told besides the model, the prompts and the graph (study=circuit's options)."""

    steps: int = 5  # integration steps (eap_ig*)
    prompts_per_pass: int = 16
    ig_steps_from: int | None = None  # the first k of eap_ig*'s sum (None: the authors' code's)
    chunk_mb: float = 64.0  # exact patching's batches
    show_progress: bool = False


Scorer = Callable[[HookedModel, Task, TaskData, EdgeGraph, Budget], Tensor]
# the edge scores in the model whose forbidden edges ([senders, receivers] bool) carry their corrupted values
Forbidding = Callable[[HookedModel, Task, TaskData, EdgeGraph, Budget, Tensor], Tensor]


@dataclass(frozen=True)
class Method:
    name: str
    description: str  # one line
    paper: str
    code: str  # the original code the scores follow
    proof: str  # the test that holds them to it
    edges: Scorer  # [senders, receivers] float64: each edge's score, NaN where there is no edge
    nodes: Scorer  # [senders]: each node's score
    integrates: bool = False  # a sum over interpolation steps: study.convergence doubles them
    forbidding: Forbidding | None = None  # where the method can score with edges forbidden (the rival search)


def _attribution(method: str) -> Scorer:
    def edges(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, b: Budget) -> Tensor:
        return attribution_scores(
            model, task, data, graph, method, b.steps, b.prompts_per_pass, b.show_progress, b.ig_steps_from
        )

    return edges


def _forbidding(method: str) -> Forbidding:
    def edges(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, b: Budget, forbidden: Tensor) -> Tensor:
        ppp = min(b.prompts_per_pass, FORBIDDING_PROMPTS)
        return forbidding_scores(
            model, task, data, graph, forbidden, method, b.steps, ppp, b.show_progress, b.ig_steps_from
        )

    return edges


def _attribution_method(name: str, description: str, paper: str, code: str, proof: str, integrates: bool) -> Method:
    """An edges/eap.py method's record: a node's score is the sum of its outgoing edges' (attribution is
    linear in the receivers)."""
    edges = _attribution(name)

    def nodes(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, b: Budget) -> Tensor:
        return torch.nan_to_num(edges(model, task, data, graph, b)).sum(1)

    forbidding = _forbidding(name) if name in RESCORED else None
    return Method(name, description, paper, code, proof, edges, nodes, integrates, forbidding)


def _exact_edges(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, b: Budget) -> Tensor:
    return exact_scores(model, task, data, graph, chunk_mb=b.chunk_mb, show_progress=b.show_progress)


def _exact_nodes(model: HookedModel, task: Task, data: TaskData, graph: EdgeGraph, b: Budget) -> Tensor:
    return exact_node_scores(model, task, data, graph)


HANNAMW = "hannamw/EAP-IG, src/eap/attribute.py"
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _attribution_method(
            "eap",
            "edge attribution patching: one clean and one corrupted forward, one backward",
            "Syed et al. 2023, arXiv 2310.10348",
            f"{HANNAMW} (get_scores_eap)",
            "tests/test_edges.py::test_eap_equals_the_reference_on_every_edge (a hand-built split forward pass)",
            integrates=False,
        ),
        _attribution_method(
            "eap_ig",
            "EAP with integrated gradients over interpolated input embeddings",
            "Hanna et al. 2024, arXiv 2403.17806; MIB, arXiv 2504.13151",
            f"{HANNAMW} (get_scores_eap_ig: k = 0..steps-1)",
            "tests/test_edges.py::test_eap_ig_equals_a_sum_by_hand_in_both_conventions_which_differ",
            integrates=True,
        ),
        _attribution_method(
            "eap_ig_activations",
            "EAP-IG over each node's interpolated output in turn",
            "MIB, arXiv 2504.13151",
            f"{HANNAMW} (get_scores_ig_activations: k = 1..steps)",
            "tests/test_edges.py::test_eap_ig_over_activations_equals_the_authors_sum_by_hand",
            integrates=True,
        ),
        Method(
            "exact",
            "every edge patched alone: exact, and the method for small graphs",
            "activation patching of edges (Wang et al. 2022's path patching, one edge at a time)",
            "hannamw/EAP-IG, src/eap/evaluate.py (evaluate_graph; MIB's exact patching of one edge)",
            "tests/test_edges.py::test_exact_patching_equals_the_reference_on_sampled_edges",
            _exact_edges,
            _exact_nodes,
        ),
    )
}


def register(method: Method) -> Method:
    """Add a circuit method defined outside headlab: `circuit=<its name>` then runs it."""
    if method.name in METHODS:
        raise UsageError(f"circuit method {method.name} is taken; choose another name")
    METHODS[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def get(name: str) -> Method:
    if name not in METHODS:
        raise UsageError(f"unknown circuit method '{name}'; choose from: {', '.join(METHODS)}")
    return METHODS[name]
