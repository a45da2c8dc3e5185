"""headlab.edges against tests/edge_reference.py, a slow hand-built split-residual forward pass on the HF weights.

Two tiny random models in float64, IOI prompts (the GPT-2 tokenizer): GPT-2-shaped (2 layers, 4 heads, d_model 32)
and Llama-shaped with GQA (4 query heads, 2 kv heads). GPT-2 in float64 agrees with the reference to rounding
(~1e-15 of the largest value). HF Llama rounds through float32 inside RMSNorm, and the reference's Llama softmax does
too (headlab's is float64), so plain Llama agrees only to float32 level; `llama64` is the same model with RMSNorm
and the reference's softmax in float64 (rotary's cos/sin are shared by both sides), where GQA must agree to rounding.
`llama` and `llama64` use the grouped key/value edges (kv_edges=grouped); `llama64u` is llama64 with MIB's
ungrouped ones (each query head its own key and value inputs), the reference's graph switched alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from types import MethodType
from typing import Any

import pytest
import torch
from torch import Tensor

import edge_reference as ref
from headlab.door import compose
from headlab.edges import rescore
from headlab.edges.eap import doubled_steps, scores
from headlab.edges.evaluate import circuit_metric
from headlab.edges.exact import exact_scores
from headlab.edges.graph import EdgeGraph
from headlab.edges.record import metric_column
from headlab.errors import UsageError
from headlab.models.families import FAMILIES
from headlab.models.hf import hook_hf, register_attention
from headlab.tasks import TaskData, build_task

N_PROMPTS = 8
# float64 throughout: agreement to 1e-10 of the largest value compared (observed ~1e-15)
FLOAT64 = 1e-10
# float32 inside (plain Llama): besides, up to 1e-6 of the metric's scale (observed up to 3e-8 of it)
FLOAT32 = 1e-6
N_EDGES = {"gpt2": 110, "llama": 82, "llama64": 82, "llama64u": 110}

# edges patched one at a time against the reference: every kind of receiver (q, k, v, mlp, logits) and sender
SAMPLED_EDGES = {
    "gpt2": [
        "input->a0.h1<q>",
        "input->a0.h2<k>",
        "a0.h2->a1.h3<k>",
        "m0->a1.h0<v>",
        "input->m0",
        "a0.h3->m0",
        "a1.h2->m1",
        "m0->m1",
        "input->logits",
        "a1.h1->logits",
        "m1->logits",
    ],
    "llama64": [
        "input->a0.h1<q>",
        "a0.h0->a1.h2<q>",
        "a0.h2->a1.kv1<k>",
        "m0->a1.kv0<v>",
        "input->a0.kv1<v>",
        "a0.h3->m0",
        "a1.h1->m1",
        "m0->logits",
        "input->logits",
    ],
    # ungrouped: an edge into one query head's key or value, and into its sibling's
    "llama64u": [
        "input->a0.h1<q>",
        "a0.h2->a1.h3<k>",
        "a0.h2->a1.h2<k>",
        "m0->a1.h0<v>",
        "m0->a1.h1<v>",
        "input->a0.h3<v>",
        "a0.h3->m0",
        "m0->logits",
    ],
    # plain Llama: one edge per kind of receiver is enough beside llama64's full sample
    "llama": ["input->a0.h1<q>", "a0.h2->a1.kv1<k>", "m0->a1.kv0<v>", "a0.h3->m0", "m0->logits"],
}


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Case:
    family: str
    hf: Any  # the HF model (the reference runs on it)
    model: Any  # headlab's HookedModel around it
    task: Any
    data: TaskData

    @property
    def gqa(self) -> bool:
        return self.family.startswith("llama")

    @cached_property
    def metric_scale(self) -> float:
        return float(self.hf_metric(self.clean_ids).abs().max())

    def tol(self, scale: float) -> float:
        """How far headlab may be from the reference where the largest value compared is `scale`."""
        return max(FLOAT64 * scale, FLOAT32 * self.metric_scale if self.family == "llama" else 0.0)

    @cached_property
    def graph(self) -> EdgeGraph:
        return EdgeGraph.of(self.model, kv_edges="ungrouped" if self.family == "llama64u" else "grouped")

    @property
    def clean_ids(self) -> Tensor:
        return self.data.inputs["input_ids"]

    @property
    def corrupt_ids(self) -> Tensor:
        assert self.data.counterfactual is not None
        return self.data.counterfactual["input_ids"]

    def metric(self, logits: Tensor) -> Tensor:
        """The task's smooth quantity (IOI: logit difference) per prompt, from full logits [n, pos, vocab]."""
        rows = torch.arange(logits.shape[0])[:, None]
        return self.task.per_prompt(logits[rows, self.data.positions], self.data)[:, metric_column(self.task)]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Around calls into the reference: for llama64, its Llama softmax in float64 too, as headlab's is."""
        if not self.family.startswith("llama64"):
            yield
            return
        softmax = ref._causal_softmax
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ref, "_causal_softmax", lambda scores, fp32: softmax(scores, fp32=False))
            yield

    def hf_metric(self, ids: Tensor) -> Tensor:
        """The metric of a plain HF forward pass (no headlab code on the way but its attention function)."""
        with torch.no_grad():
            return self.metric(self.hf(input_ids=ids, use_cache=False).logits)

    @cached_property
    def eap(self) -> Tensor:
        return scores(self.model, self.task, self.data, self.graph, "eap")

    @cached_property
    def exact(self) -> Tensor:
        return exact_scores(self.model, self.task, self.data, self.graph)

    def index(self, edge: str) -> tuple[int, int]:
        sender, _, receiver = edge.partition("->")
        return (
            [s.name for s in self.graph.senders].index(sender),
            [r.name for r in self.graph.receivers].index(receiver),
        )

    def mask(self, edges: list[str]) -> Tensor:
        out = torch.zeros_like(self.graph.real)
        for edge in edges:
            out[self.index(edge)] = True
        return out


def _rms_norm_float64(self, x: Tensor) -> Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _build(family: str, tokenizer) -> Case:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    register_attention()
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50257, n_positions=64)
    else:
        cfg = LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=50257,
            max_position_embeddings=64,
        )
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="headlab").double().eval()
    if family.startswith("llama64"):  # this model's RMSNorms only, without HF's round trip through float32
        for module in hf.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = MethodType(_rms_norm_float64, module)
    if family == "llama64u":
        hf.config.headlab_kv_edges = "ungrouped"  # the reference's graph (edge_reference._ungrouped)
    model = hook_hf(hf, f"tiny-{family}", FAMILIES[cfg.model_type], tokenizer)
    task = build_task(compose(["task=ioi", f"task.n_prompts={N_PROMPTS}"]).task)
    data = task.build(N_PROMPTS, 0, model)
    return Case(family, hf, model, task, data)


@pytest.fixture(scope="module")
def built(gpt2_tokenizer):
    """family -> its Case, each built once for this module (scores cached with it)."""
    cases: dict[str, Case] = {}

    def get(family: str) -> Case:
        if family not in cases:
            cases[family] = _build(family, gpt2_tokenizer)
        return cases[family]

    yield get
    cases.clear()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request, built) -> Case:
    return built(request.param)


# the comparisons with the reference also run on Llama in float64 throughout
WITH_LLAMA64 = pytest.mark.parametrize("case", ["gpt2", "llama", "llama64", "llama64u"], indirect=True)


@pytest.fixture(scope="module")
def gpt2_case(built) -> Case:
    return built("gpt2")


def _values(case: Case, by_name: dict[str, float]) -> Tensor:
    """A reference {edge: value} as a vector in headlab's edge order."""
    return torch.tensor([by_name[e] for e in case.graph.edge_names()], dtype=torch.float64)


def _pearson(a: Tensor, b: Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


# --- 1. the graph ------------------------------------------------------------------------------------


def test_graph_names_and_order_match_the_reference(case):
    g = case.graph
    assert [s.name for s in g.senders] == ref.senders(case.hf)
    assert [r.name for r in g.receivers] == ref.receivers(case.hf)
    assert g.edge_names() == ref.edges(case.hf)
    assert g.n_edges == int(g.real.sum()) == len(ref.edges(case.hf)) == N_EDGES[case.family]
    assert g.real.shape == (len(g.senders), len(g.receivers))
    if case.gqa:  # GQA: the kv heads are receivers of their own, never one per query head
        assert [r.name for r in g.receivers if r.layer == 0 and r.kind in "kv"] == [
            "a0.kv0<k>",
            "a0.kv1<k>",
            "a0.kv0<v>",
            "a0.kv1<v>",
        ]
    some = case.mask(["m0->logits", "input->a0.h1<q>"])
    assert g.edge_names(some) == ["input->a0.h1<q>", "m0->logits"]  # sender-major


def test_ungrouped_key_value_edges_are_one_per_query_head_and_grouped_ones_count_as_them(built):
    case, grouped = built("llama64u"), built("llama64").graph
    g = case.graph
    assert [r.name for r in g.receivers] == ref.receivers(case.hf) and g.edge_names() == ref.edges(case.hf)
    assert [r.name for r in g.receivers if r.layer == 0 and r.kind in "kv"] == [
        *(f"a0.h{h}<k>" for h in range(4)),
        *(f"a0.h{h}<v>" for h in range(4)),
    ]
    assert g.n_edges == g.total(ungrouped=True) == grouped.total(ungrouped=True) == N_EDGES["llama64u"]
    assert not g.grouped and g.expands_kv and grouped.grouped and not grouped.expands_kv


def test_an_attention_only_toy_model_has_no_mlp_nodes():
    from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy

    toy = hooked_toy(ToyTransformer(ToyConfig(vocab_size=7, n_layers=2, d_model=32, d_head=8, d_mlp=0)), "toy")
    g = EdgeGraph.of(toy)
    assert [s.name for s in g.senders] == ["input"] + [f"a{layer}.h{h}" for layer in range(2) for h in range(4)]
    assert not any(r.kind == "mlp" for r in g.receivers)
    # layer 0's 12 q/k/v receivers read the input, layer 1's read input + 4 heads, the logits read all 9 senders
    assert g.n_edges == 12 * 1 + 12 * 5 + 9


# --- 2. EAP ----------------------------------------------------------------------------------------


@WITH_LLAMA64
def test_eap_equals_the_reference_on_every_edge(case):
    got = case.eap
    with case.reference():
        want = _values(case, ref.eap_scores(case.hf, case.clean_ids, case.corrupt_ids, case.metric))
    assert got.dtype == torch.float64 and got.shape == case.graph.real.shape
    assert torch.isnan(got[~case.graph.real]).all() and not torch.isnan(got[case.graph.real]).any()
    scale = float(want.abs().max())
    assert scale > 1e-4  # the comparison is not between zeros
    err = (got[case.graph.real] - want).abs()
    worst = int(err.argmax())
    assert float(err.max()) <= case.tol(scale), (
        f"{case.graph.edge_names()[worst]}: headlab {float(got[case.graph.real][worst])!r} vs reference "
        f"{float(want[worst])!r} (largest reference score {scale})"
    )


def test_eap_does_not_depend_on_how_prompts_are_batched(case):
    split = scores(case.model, case.task, case.data, case.graph, "eap", prompts_per_pass=3)  # 3 + 3 + 2 prompts
    real = case.graph.real
    assert float((split[real] - case.eap[real]).abs().max()) <= case.tol(float(case.eap[real].abs().max()))


# --- 3. exact edge patching ------------------------------------------------------------------------


@WITH_LLAMA64
def test_exact_patching_equals_the_reference_on_sampled_edges(case):
    edges = SAMPLED_EDGES[case.family]
    kinds = {case.graph.receivers[case.index(e)[1]].kind for e in edges}
    assert kinds == {"q", "k", "v", "mlp", "logits"}
    which = case.mask(edges)
    got = exact_scores(case.model, case.task, case.data, case.graph, which=which)
    assert torch.isnan(got[~which]).all() and not torch.isnan(got[which]).any()
    with case.reference():
        want = {e: ref.exact_edge_score(case.hf, case.clean_ids, case.corrupt_ids, case.metric, e) for e in edges}
    scale = max(abs(v) for v in want.values())
    assert scale > 1e-5
    for e in edges:
        assert abs(float(got[case.index(e)]) - want[e]) <= case.tol(scale), (
            f"{e}: headlab {float(got[case.index(e)])!r} vs reference {want[e]!r}"
        )
    # the subset is computed as the full run computes it
    assert torch.equal(got[which], case.exact[which])


# --- 4. the metric of a circuit --------------------------------------------------------------------


def test_the_full_circuit_is_the_clean_run_and_the_empty_one_the_corrupted_run(case):
    clean, corrupt = case.hf_metric(case.clean_ids), case.hf_metric(case.corrupt_ids)
    scale = float(clean.abs().max())
    assert float((clean - corrupt).abs().max()) > 1e-3  # the two ends differ
    full = circuit_metric(case.model, case.task, case.data, case.graph, case.graph.real.clone())
    empty = circuit_metric(case.model, case.task, case.data, case.graph, torch.zeros_like(case.graph.real))
    assert full.shape == empty.shape == (N_PROMPTS,)
    assert float((full - clean).abs().max()) <= case.tol(scale)
    assert float((empty - corrupt).abs().max()) <= case.tol(scale)


def test_the_circuit_without_one_edge_changes_the_metric_by_that_edges_exact_score(case):
    clean = case.hf_metric(case.clean_ids)
    edges = SAMPLED_EDGES[case.family][::2]
    scale = float(case.exact[case.graph.real].abs().max())
    for e in edges:
        circuit = case.graph.real.clone()
        circuit[case.index(e)] = False
        change = float((circuit_metric(case.model, case.task, case.data, case.graph, circuit) - clean).mean())
        assert abs(change - float(case.exact[case.index(e)])) <= case.tol(scale), (
            f"{e}: circuit {change!r} vs exact {float(case.exact[case.index(e)])!r}"
        )


def _reference_circuit_metric(case: Case, kept: set[str]) -> Tensor:
    """The reference's split forward pass with every edge outside `kept` patched: receiver R reads its clean-run
    input plus, per cut sender U, out_U(corrupt) - out_U(this run). This run's sender outputs are found by
    iterating to the fixed point: each pass settles one more node of the chain input, a0, m0, a1, m1, ..., so the
    logits are exact after 2 * n_layers + 1 passes (one more to see that nothing moves)."""
    everything = ref.edges(case.hf)
    cut: dict[str, list[str]] = {}
    for edge in everything:
        if edge not in kept:
            sender, receiver = edge.split("->")
            cut.setdefault(receiver, []).append(sender)
    with torch.no_grad(), case.reference():
        _, corrupt = ref.split_forward(case.hf, case.corrupt_ids)
        _, current = ref.split_forward(case.hf, case.clean_ids)
        passes = []
        for _ in range(2 * case.graph.n_layers + 2):
            fns = {
                receiver: (lambda x, d=sum(corrupt[s] - current[s] for s in senders): x + d)
                for receiver, senders in cut.items()
            }
            logits, current = ref.split_forward(case.hf, case.clean_ids, fns)
            passes.append(case.metric(logits))
    assert torch.equal(passes[-1], passes[-2])  # the fixed point was reached
    return passes[-1]


@WITH_LLAMA64
@pytest.mark.parametrize("share", [None, 0.5])
def test_circuit_metric_equals_the_reference_on_a_partial_circuit(case, share):
    # 25 edges: most receivers read the senders' sum less their few kept edges; half of the edges: each
    # receiver its own mixture of kept and cut edges, both kinds in one product
    g = case.graph
    size = 25 if share is None else int(share * g.n_edges)
    circuit = g.top_n(case.eap, size, prune=False)  # unpruned: dangling edges must be handled too
    got = circuit_metric(case.model, case.task, case.data, g, circuit)
    want = _reference_circuit_metric(case, set(g.edge_names(circuit)))
    clean, corrupt = case.hf_metric(case.clean_ids), case.hf_metric(case.corrupt_ids)
    # a circuit strictly between the two ends
    assert float((want - clean).abs().max()) > 1e-4 and float((want - corrupt).abs().max()) > 1e-4
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= case.tol(scale), (got.tolist(), want.tolist())


# --- 5. EAP-IG -------------------------------------------------------------------------------------


def test_eap_ig_with_one_step_is_eap(case):
    # alpha = k / steps for k = 1..steps (the paper's convention): one step is the clean point alone
    one = scores(case.model, case.task, case.data, case.graph, "eap_ig", steps=1, ig_steps_from=1)
    real = case.graph.real
    assert torch.isnan(one[~real]).all()
    assert float((one[real] - case.eap[real]).abs().max()) <= case.tol(float(case.eap[real].abs().max()))


@WITH_LLAMA64
def test_eap_ig_equals_a_sum_by_hand_in_both_conventions_which_differ(case):
    # the reference sums the gradient over alpha = k/3 with autograd on its own forward pass: k = 1..3 (the paper)
    # and k = 0..2 (hannamw/EAP-IG's code, MIB: headlab's default)
    real = case.graph.real
    got = {}
    for steps_from in (0, 1):
        got[steps_from] = scores(case.model, case.task, case.data, case.graph, "eap_ig", 3, ig_steps_from=steps_from)
        with case.reference():
            by_hand = ref.eap_ig_scores(case.hf, case.clean_ids, case.corrupt_ids, case.metric, 3, steps_from)
        want = _values(case, by_hand)
        scale = float(want.abs().max())
        assert scale > 1e-4
        err = float((got[steps_from][real] - want).abs().max())
        assert err <= min(1e-5, case.tol(scale)), (steps_from, err, scale)
    apart = float((got[0][real] - got[1][real]).abs().max())
    assert apart > 1e-2 * float(got[1][real].abs().max()), apart  # the conventions are not the same number
    with pytest.raises(UsageError, match="ig_steps_from=2"):
        scores(case.model, case.task, case.data, case.graph, "eap_ig", steps=3, ig_steps_from=2)


@WITH_LLAMA64
def test_eap_ig_over_activations_equals_the_authors_sum_by_hand(case):
    # hannamw/EAP-IG's get_scores_ig_activations: every node in turn, k = 1..steps (the default), unlike
    # get_scores_eap_ig's k = 0..steps-1
    real = case.graph.real
    got = scores(case.model, case.task, case.data, case.graph, "eap_ig_activations", 2)
    with case.reference():
        by_hand = ref.eap_ig_activation_scores(case.hf, case.clean_ids, case.corrupt_ids, case.metric, 2, 1)
        other = ref.eap_ig_activation_scores(case.hf, case.clean_ids, case.corrupt_ids, case.metric, 2, 0)
    want = _values(case, by_hand)
    scale = float(want.abs().max())
    assert scale > 1e-4
    err = float((got[real] - want).abs().max())
    assert err <= min(1e-5, case.tol(scale)), (err, scale)
    assert float((_values(case, other) - want).abs().max()) > 1e-2 * scale  # k = 0..1 is another number


@pytest.mark.parametrize("method", ["eap_ig", "eap_ig_activations"])
def test_scores_at_twice_the_steps_from_the_odd_alphas_equal_a_run_at_twice_the_steps(case, method):
    real = case.graph.real
    for steps_from in (0, 1):
        at_2 = scores(case.model, case.task, case.data, case.graph, method, 2, ig_steps_from=steps_from)
        want = scores(case.model, case.task, case.data, case.graph, method, 4, ig_steps_from=steps_from)
        got = doubled_steps(case.model, case.task, case.data, case.graph, method, at_2, 2, ig_steps_from=steps_from)
        assert torch.isnan(got[~real]).all()
        err = float((got[real] - want[real]).abs().max())
        assert err <= case.tol(float(want[real].abs().max())), (steps_from, err)
        assert float((at_2[real] - want[real]).abs().max()) > 10 * err  # steps matter: the test can fail


def test_eap_ig_tracks_exact_patching_better_than_eap(case):
    # measured over 5 seeds x {gpt2, llama} (2 layers, d 32, 8 IOI prompts): Pearson(EAP-IG 10 steps, exact) was
    # 0.9982-0.9999, Pearson(EAP, exact) 0.86-0.99, EAP-IG above EAP every time; this seed: 0.998 / 0.877 (GPT-2),
    # 0.999 / 0.956 (Llama)
    real = case.graph.real
    ig = scores(case.model, case.task, case.data, case.graph, "eap_ig", steps=10)[real]
    exact = case.exact[real]
    r_ig, r_eap = _pearson(ig, exact), _pearson(case.eap[real], exact)
    assert r_ig > 0.995 and r_ig > r_eap, (r_ig, r_eap)


# --- 5b. scores with edges forbidden (the audit's rival search: edges/rescore.py) -----------------


def test_scores_with_nothing_forbidden_are_eap_and_eap_igs(case):
    real, nothing = case.graph.real, torch.zeros_like(case.graph.real)
    for method, steps in (("eap", 1), ("eap_ig", 3)):
        want = scores(case.model, case.task, case.data, case.graph, method, steps)
        got = rescore.scores(case.model, case.task, case.data, case.graph, nothing, method, steps, prompts_per_pass=3)
        assert torch.isnan(got[~real]).all()
        err = float((got[real] - want[real]).abs().max())
        assert err <= case.tol(float(want[real].abs().max())), (method, err)


@WITH_LLAMA64
def test_scores_with_edges_forbidden_equal_the_reference_with_those_edges_cut(case):
    g = case.graph
    forbidden = g.top_n(case.eap, 12, prune=False)
    allowed = g.real & ~forbidden
    got = rescore.scores(case.model, case.task, case.data, g, forbidden, "eap_ig", 3, prompts_per_pass=5)
    with case.reference():
        by_hand = ref.eap_ig_scores(
            case.hf, case.clean_ids, case.corrupt_ids, case.metric, 3, 0, frozenset(g.edge_names(forbidden))
        )
    want = torch.tensor([by_hand[e] for e in g.edge_names(allowed)], dtype=torch.float64)
    assert torch.isnan(got[forbidden]).all()
    scale = float(want.abs().max())
    err = float((got[allowed] - want).abs().max())
    assert err <= min(1e-5, case.tol(scale)), (err, scale)
    # forbidding moves the other edges' scores: the test can fail
    plain = scores(case.model, case.task, case.data, g, "eap_ig", 3)[allowed]
    assert float((plain - want).abs().max()) > 1e-2 * scale


# --- 6. circuits: selection, pruning, files --------------------------------------------------------


def _owners(case: Case, receiver: str) -> set[str]:
    """The sender nodes a receiver belongs to, from the names alone (a kv receiver: every query head of its
    group)."""
    if receiver == "logits":
        return set()
    node, _, port = receiver.partition("<")
    if not port:
        return {node}  # an MLP
    layer, head = node.split(".")
    if head.startswith("kv"):
        group = case.graph.n_heads // case.graph.n_kv_heads
        j = int(head[2:])
        return {f"{layer}.h{h}" for h in range(j * group, (j + 1) * group)}
    return {node}


def _reached_from_logits(case: Case, edges: list[str]) -> set[str]:
    """The edges of `edges` with a path through `edges` to the logits."""
    open_receivers, reached = {"logits"}, set()
    while True:
        new = {e for e in edges if e.split("->")[1] in open_receivers} - reached
        if not new:
            return reached
        reached |= new
        for e in new:
            open_receivers |= {r for r in ref.receivers(case.hf) if e.split("->")[0] in _owners(case, r)}


def _fed(case: Case, edges: list[str]) -> bool:
    """Every sender of `edges` is the input or has an edge of `edges` into one of its receivers."""
    into = {e.split("->")[1] for e in edges}
    return all(s == "input" or any(s in _owners(case, r) for r in into) for s in {e.split("->")[0] for e in edges})


def test_top_n_without_pruning_is_the_n_largest_scores(gpt2_case):
    case, n = gpt2_case, 15
    names = case.graph.edge_names()
    values = case.eap[case.graph.real].tolist()
    for absolute in (True, False):
        key = [abs(v) if absolute else v for v in values]
        order = sorted(range(len(names)), key=lambda i: -key[i])
        assert key[order[n - 1]] > key[order[n]]  # no tie at the cut
        mask = case.graph.top_n(case.eap, n, absolute=absolute, prune=False)
        assert int(mask.sum()) == n
        assert set(case.graph.edge_names(mask)) == {names[i] for i in order[:n]}
        ranked = case.graph.ranking(case.eap, absolute)
        assert ranked.shape == (case.graph.n_edges,)
        assert [key[i] for i in order] == [(abs(v) if absolute else v) for v in case.eap.flatten()[ranked].tolist()]


def test_pruning_drops_edges_that_reach_nothing_or_come_from_nothing(case):
    g = case.graph
    kept = ["input->a0.h0<q>", "a0.h0->logits"]
    assert g.edge_names(g.prune(case.mask(kept))) == kept
    # a head no circuit edge reaches: its edge to the logits goes
    assert not g.prune(case.mask(["a0.h0->logits", "a1.h2->logits"])).any()
    assert g.edge_names(g.prune(case.mask(["a0.h0->logits", "input->logits"]))) == ["input->logits"]
    # a chain into an MLP whose output goes nowhere: pruned to the fixed point, all of it
    assert not g.prune(case.mask(["input->a0.h0<q>", "a0.h0->m0"])).any()
    if case.gqa:  # kv1 belongs to query heads 2 and 3, not to head 1
        assert g.edge_names(g.prune(case.mask(["input->a0.kv0<k>", "a0.h1->logits"]))) == [
            "input->a0.kv0<k>",
            "a0.h1->logits",
        ]
        assert not g.prune(case.mask(["input->a0.kv1<k>", "a0.h1->logits"])).any()
    top = g.top_n(case.eap, 30)
    assert torch.equal(top, g.prune(g.top_n(case.eap, 30, prune=False)))
    assert torch.equal(g.prune(top), top)
    edges = g.edge_names(top)
    assert _reached_from_logits(case, edges) == set(edges) and _fed(case, edges)


def test_greedy_circuits_are_connected_to_the_logits(case):
    g = case.graph
    names, values = g.edge_names(), case.eap[g.real].abs().tolist()
    best_into_logits = max((v, e) for e, v in zip(names, values) if e.endswith("->logits"))[1]
    grown = g.greedy(case.eap, 20, prune=False)
    edges = g.edge_names(grown)
    assert len(edges) == 20 and best_into_logits in edges
    assert _reached_from_logits(case, edges) == set(edges)
    pruned = g.edge_names(g.greedy(case.eap, 20))
    assert pruned and set(pruned) <= set(edges)
    assert _reached_from_logits(case, pruned) == set(pruned) and _fed(case, pruned)


def test_json_has_eap_igs_layout_and_round_trips(case):
    g = case.graph
    circuit = g.top_n(case.eap, 20)
    doc = json.loads(json.dumps(g.to_json(case.eap, circuit)))  # plain JSON types only
    assert set(doc) == {"cfg", "nodes", "edges"}
    assert doc["cfg"]["n_layers"] == 2 and doc["cfg"]["n_heads"] == 4 and doc["cfg"]["d_model"] == 32
    assert doc["cfg"]["parallel_attn_mlp"] is False
    assert doc["cfg"].get("n_key_value_heads") == (2 if case.gqa else None)
    assert list(doc["edges"]) == ref.edges(case.hf)
    in_circuit = set(g.edge_names(circuit))
    for name, entry, value in zip(doc["edges"], doc["edges"].values(), case.eap[g.real].tolist()):
        assert entry == {"score": value, "in_graph": name in in_circuit}
    assert set(doc["nodes"]) == set(ref.senders(case.hf)) | {"logits"}
    touched = {e.split("->")[0] for e in in_circuit} | {s for e in in_circuit for s in _owners(case, e.split("->")[1])}
    assert {k for k, v in doc["nodes"].items() if v == {"in_graph": True}} == touched | {"logits"}
    back_scores, back_mask = g.from_json(doc)
    assert torch.equal(back_mask, circuit)
    assert torch.equal(back_scores.isnan(), ~g.real) and torch.equal(back_scores[g.real], case.eap[g.real])
    doc["edges"]["a9.h0->logits"] = {"score": 0.0, "in_graph": False}
    with pytest.raises(UsageError, match="a9.h0->logits"):
        g.from_json(doc)


# --- 7. models with norms on their components' outputs, and models whose edges are not defined ------------


def _tiny_post_normed(family: str):
    import transformers

    register_attention()
    config_class = {
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "olmo2": transformers.Olmo2Config,
    }[family]
    shape = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, vocab_size=128)
    extra = dict(num_key_value_heads=2, head_dim=8) if family.startswith("gemma") else {}
    cfg = config_class(**shape, **extra, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="headlab").eval()
    return hook_hf(hf, f"tiny-{family}", FAMILIES[family], None)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_post_normed_model_builds_its_graph_under_either_rule(family):
    # the graph of a Llama of the same shape; what its edges carry is postnorm.py's rule (tests/test_edges_postnorm.py)
    hooked = _tiny_post_normed(family)
    assert not hooked.residual_sum
    assert EdgeGraph.of(hooked).post_norm == "mib"  # MIB's code, by default
    for rule in ("mib", "shares"):
        g = EdgeGraph.of(hooked, rule)
        assert g.post_norm == rule and g.n_edges == N_EDGES["llama64u"] and g.n_kv_heads == 2
        assert g.to_json(torch.zeros(g.real.shape))["cfg"]["post_norm"] == rule
    _refused(lambda: EdgeGraph.of(hooked, "frozen"), "post_norm=frozen: choose one of mib, shares")


def test_olmo2_is_hooked_and_its_edges_refused():
    _refused(lambda: EdgeGraph.of(_tiny_post_normed("olmo2")), "edges do not cover olmo2: .*q/k norms span every head")


def test_a_model_without_a_residual_sum_or_known_attention_inputs_is_refused(gpt2_case, monkeypatch):
    model = gpt2_case.model
    assert EdgeGraph.of(model, "shares").post_norm is None  # the rule is a post-norm model's alone
    _refused(lambda: EdgeGraph.of(model, "frozen"), "post_norm=frozen")
    monkeypatch.setattr(model, "residual_sum", False)  # a post-norm model of a family postnorm.py does not know
    with pytest.raises(UsageError, match="its edges are not defined"):
        EdgeGraph.of(model)
    monkeypatch.setattr(model, "residual_sum", True)
    monkeypatch.setattr(model, "attn_inputs", [None] * model.n_layers)
    with pytest.raises(UsageError, match="where its attention reads"):
        EdgeGraph.of(model)


# --- 8. bad input ----------------------------------------------------------------------------------


def _refused(call, match: str) -> None:
    with pytest.raises(UsageError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_prompts_edges_cannot_pair_are_refused_in_one_line(gpt2_case):
    case = gpt2_case
    ids = case.clean_ids
    bad = {
        "counterfactual prompts": replace(case.data, counterfactual=None),
        r"as long as the clean ones \(\(8, \d+\) vs \(8, \d+\) tokens\)": replace(
            case.data, counterfactual={"input_ids": ids[:, :-1]}
        ),
        "laid out like the clean ones": replace(
            case.data, counterfactual_positions={"END": torch.zeros(N_PROMPTS, dtype=torch.long)}
        ),
    }
    for match, data in bad.items():
        _refused(lambda data=data: scores(case.model, case.task, data, case.graph), match)
        _refused(lambda data=data: exact_scores(case.model, case.task, data, case.graph), match)
        _refused(lambda data=data: circuit_metric(case.model, case.task, data, case.graph, case.graph.real), match)
    _refused(lambda: scores(case.model, case.task, case.data, case.graph, "eap_gi"), "unknown attribution method")


def test_a_task_without_a_smooth_quantity_is_refused():
    from conftest import counting_cfg
    from headlab.models.toy import ToyConfig, ToyTransformer, hooked_toy
    from headlab.tasks.counting import CountingTask

    task = CountingTask(counting_cfg(n_prompts=6, max_len=12))
    torch.manual_seed(0)
    toy = hooked_toy(ToyTransformer(ToyConfig(vocab_size=task.vocab_size, n_layers=2, d_model=32, d_mlp=32)), "toy")
    data = task.build(6, 0, toy)
    assert data.counterfactual is not None and task.smooth_quantity is None
    graph = EdgeGraph.of(toy)
    assert [s.name for s in graph.senders] == ["input"] + [
        name for layer in range(2) for name in [f"a{layer}.h{h}" for h in range(4)] + [f"m{layer}"]
    ]
    _refused(lambda: scores(toy, task, data, graph), r"task counting .*smooth")
    _refused(lambda: exact_scores(toy, task, data, graph), r"task counting .*smooth")
    _refused(lambda: circuit_metric(toy, task, data, graph, graph.real), r"task counting .*smooth")


# --- 6. circuit sizes counted ungrouped, and intervals over prompts -------------------------------------


def test_grouped_edges_counted_ungrouped_are_the_edges_of_the_ungrouped_graph(case):
    g = case.graph
    ungrouped = EdgeGraph(g.n_layers, g.n_heads, g.n_heads, g.d_model, g.parallel, g.mlp_layers)
    assert g.total(ungrouped=True) == ungrouped.n_edges
    assert (g.total(ungrouped=True) > g.n_edges) == (g.n_kv_heads != g.n_heads)


def test_a_top_n_circuit_counted_ungrouped_is_the_longest_prefix_of_the_ranking_that_fits(case):
    g, weights = case.graph, case.graph.multiplicity.flatten()
    ranked = g.ranking(case.eap).tolist()
    for n in (1, 7, g.total(ungrouped=True) // 3):
        mask = g.top_n(case.eap, n, prune=False, ungrouped=True)
        taken = sum(1 for _ in mask.nonzero())
        assert g.size(mask, ungrouped=True) <= n
        assert set(mask.flatten().nonzero().flatten().tolist()) == set(ranked[:taken])
        if taken < len(ranked):  # the next edge would overflow n
            assert g.size(mask, ungrouped=True) + int(weights[ranked[taken]]) > n


def test_cpr_on_a_bootstrap_resample_is_cpr_measured_on_those_prompts(gpt2_case):
    """The intervals resample prompts without rerunning a circuit: one resample's CPR and CMD must be what
    measure gives when handed exactly those prompts."""
    import numpy as np

    from headlab.edges import faithfulness

    case, fractions = gpt2_case, (0.3, 1.0)
    n_boot, seed = 2, 5
    f = faithfulness.measure(
        case.model, case.task, case.data, case.graph, case.eap, fractions, n_boot=n_boot, seed=seed
    )
    idx = np.random.default_rng(seed).integers(0, case.data.n, size=(n_boot, case.data.n))
    cprs, cmds = [], []
    for rows in idx:
        part = case.data.take(torch.as_tensor(rows))  # type: ignore[arg-type]
        g = faithfulness.measure(case.model, case.task, part, case.graph, case.eap, fractions, n_boot=0)
        cprs.append(g.cpr)
        cmds.append(g.cmd)
    assert f.cpr_ci[0] == pytest.approx(np.percentile(cprs, 2.5), abs=1e-9)
    assert f.cpr_ci[1] == pytest.approx(np.percentile(cprs, 97.5), abs=1e-9)
    assert f.cmd_ci[0] == pytest.approx(np.percentile(cmds, 2.5), abs=1e-9)
    assert f.cmd_ci[0] <= f.cmd_ci[1]


def test_the_curve_holding_a_few_prompts_recordings_at_a_time_measures_what_it_measures_holding_all(gpt2_case):
    """Evaluator(held=k): the prompts measured k at a time, each slice recorded once for the curve's circuits
    and again for each bisection step: the same curve, CPR, CMD and smallest circuit."""
    from headlab.edges import faithfulness

    case, fractions = gpt2_case, (0.1, 0.3, 1.0)
    whole = faithfulness.measure(case.model, case.task, case.data, case.graph, case.eap, fractions, n_boot=0)
    held = 2 if case.data.n > 2 else 1
    sliced = faithfulness.measure(
        case.model, case.task, case.data, case.graph, case.eap, fractions, n_boot=0, held=held
    )
    for a, b in zip(whole.points, sliced.points):
        assert a.n_edges == b.n_edges
        assert b.per_prompt == pytest.approx(a.per_prompt, abs=1e-9)
    assert (sliced.cpr, sliced.cmd) == pytest.approx((whole.cpr, whole.cmd), abs=1e-9)
    assert torch.equal(sliced.target_circuit, whole.target_circuit)


def test_each_circuit_method_record_names_its_paper_code_and_a_test_that_exists():
    from pathlib import Path

    from headlab.edges.methods import METHODS

    here = Path(__file__).parent
    for method in METHODS.values():
        assert method.paper and method.code and method.description
        path, _, name = method.proof.partition("::")
        test = name.split()[0]
        assert (here.parent / path).is_file() and f"def {test}(" in (here.parent / path).read_text(), method.name


class Float64RMSNorm(torch.nn.Module):
    """An RMSNorm that computes in its input's dtype (HF's round through float32), of weight or offset + weight."""

    def __init__(self, d: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight, self.eps, self.offset = torch.nn.Parameter(torch.randn(d)), eps, offset

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight)


def _norms() -> dict[str, tuple[torch.nn.Module, float, float]]:
    """name: (a norm, its model's norm_offset, the tolerance of float64 inputs: HF's RMSNorms round through
    float32)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    torch.manual_seed(0)
    layer, llama, gemma = torch.nn.LayerNorm(16), LlamaRMSNorm(16, eps=1e-2), Gemma3RMSNorm(16, eps=1e-2)
    for module in (layer, llama, gemma):
        for p in module.parameters():
            torch.nn.init.normal_(p)
    return {
        "layernorm": (layer, 0.0, 1e-10),
        "olmo": (OlmoLayerNorm(16), 0.0, 1e-5),
        "rms": (Float64RMSNorm(16, 1e-2, 0.0), 0.0, 1e-10),
        "rms_offset": (Float64RMSNorm(16, 1e-2, 1.0), 1.0, 1e-10),
        "llama": (llama, 0.0, 1e-5),
        "gemma3": (gemma, 1.0, 1e-5),
    }


@pytest.mark.parametrize("name", ["layernorm", "olmo", "rms", "rms_offset", "llama", "gemma3"])
def test_the_closed_form_norm_products_are_autograds(name):
    """EAP takes every head's gradient back through the attention norm in closed form (models/norms.norm_vjp),
    its factor read off the norm's output: equal to autograd's products through the module itself, with an
    epsilon large enough to matter."""
    from headlab.models.norms import norm_vjp

    module, offset, tol = _norms()[name]
    module = module.double()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    cotangents = torch.randn(5, 2, 3, 16, dtype=torch.float64)
    stacked = x.repeat(5, 1, 1).requires_grad_()
    (expected,) = torch.autograd.grad(module(stacked), stacked, cotangents.flatten(0, 1))
    got = norm_vjp(module, offset, x, cotangents)
    assert got is not None
    torch.testing.assert_close(got, expected.unflatten(0, (5, 2)), rtol=tol, atol=tol)
    x[1, 2] = 0.0  # a position of zeros: its factor is not in the output, so autograd takes it
    assert norm_vjp(module, offset, x, cotangents) is None
