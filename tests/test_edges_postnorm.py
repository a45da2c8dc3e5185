"""headlab.edges on post-norm models (Gemma 2, Gemma 3) against a hand-patched forward pass of the HF model.

Tiny random models in float64 (2 layers, 4 query heads over 2 kv heads, d_model 32), every RMSNorm's weight drawn at
random (so 1 + w is no constant) and run in float64 (HF's rounds through float32). The reference below knows nothing
of headlab's edge code: it reads each sender's output off hooks on the HF modules (o_proj's input, the norms'
inputs and outputs) and patches one receiver by editing its own projection columns (q, k, v), its norm's input
(MLP) or the final norm's input (logits). Both rules of postnorm.py: mib (MIB's code) and shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import MethodType
from typing import Any

import pytest
import torch
from torch import Tensor

from headlab.door import compose
from headlab.edges import rescore
from headlab.edges.eap import scores
from headlab.edges.evaluate import circuit_metric, clean_and_corrupted
from headlab.edges.exact import exact_node_scores, exact_scores
from headlab.edges.graph import EdgeGraph
from headlab.edges.record import metric_column, record, sender_outputs
from headlab.models.families import FAMILIES
from headlab.models.hf import hook_hf, register_attention
from headlab.tasks import TaskData, build_task

N_PROMPTS = 6
HEAD_DIM = 8
TOL = 1e-10  # of the largest value compared: float64 throughout
# every kind of receiver, and every kind of sender (the input, heads of both layers, an MLP)
SAMPLED = [
    "input->a0.h1<q>",
    "a0.h2->a1.h3<q>",
    "a0.h0->a1.kv1<k>",
    "m0->a1.kv0<v>",
    "a0.h3->m0",
    "a1.h1->m1",
    "a0.h1->logits",
    "m1->logits",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _rms_norm_float64(self, x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


@dataclass
class Case:
    hf: Any
    model: Any
    task: Any
    data: TaskData

    @property
    def layers(self) -> Any:
        return self.hf.model.layers

    def graph(self, rule: str) -> EdgeGraph:
        # the hand-patched references here patch a key/value head's shared input (tests/test_edges.py's
        # llama64u holds the ungrouped edges to its reference)
        return EdgeGraph.of(self.model, rule, kv_edges="grouped")

    def index(self, graph: EdgeGraph, edge: str) -> tuple[int, int]:
        sender, _, receiver = edge.partition("->")
        return [s.name for s in graph.senders].index(sender), [r.name for r in graph.receivers].index(receiver)

    def metric(self, logits: Tensor) -> Tensor:
        """The task's smooth quantity per prompt from logits at the positions it reads ([n, len(keep), vocab])."""
        at = torch.searchsorted(self.keep, self.data.positions)
        rows = torch.arange(logits.shape[0])[:, None]
        return self.task.per_prompt(logits[rows, at], self.data)[:, metric_column(self.task)]

    @cached_property
    def keep(self) -> Tensor:
        return self.data.positions.unique()

    def forward(self, ids: Tensor) -> Tensor:
        """The metric of a plain HF pass (logits where the metric reads them: the vocabulary is GPT-2's)."""
        return self.metric(self.hf(input_ids=ids, use_cache=False, logits_to_keep=self.keep).logits)

    def ids(self, corrupt: bool = False) -> Tensor:
        inputs = self.data.counterfactual if corrupt else self.data.inputs
        assert inputs is not None
        return inputs["input_ids"]

    # --- the reference ---------------------------------------------------------------------------------
    @cached_property
    def clean(self) -> dict[str, Tensor]:
        return self.run()

    @cached_property
    def corrupt(self) -> dict[str, Tensor]:
        return self.run(corrupt=True)

    def run(self, corrupt: bool = False) -> dict[str, Tensor]:
        """One plain HF pass: the embedding, per layer o_proj's input (z), the attention norm's input (A) and
        the MLP norm's output."""
        seen: dict[str, Tensor] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(_module, args, *rest) -> None:
                # a pre-hook with kwargs (the block), a pre-hook (o_proj, a norm's input) or a hook (a norm's output)
                seen[name] = rest[-1] if name.startswith("m") else args[0] if args else rest[0]["hidden_states"]

            return hook

        handles = [self.layers[0].register_forward_pre_hook(keep("input"), with_kwargs=True)]
        for l, block in enumerate(self.layers):
            handles += [
                block.self_attn.o_proj.register_forward_pre_hook(keep(f"z{l}")),
                block.post_attention_layernorm.register_forward_pre_hook(keep(f"A{l}")),
                block.post_feedforward_layernorm.register_forward_hook(keep(f"m{l}")),
            ]
        with torch.no_grad():
            self.forward(self.ids(corrupt))
        for handle in handles:
            handle.remove()
        return seen

    def r(self, seen: dict[str, Tensor], l: int, h: int) -> Tensor:
        """Head h's z_h W_O[h] before its layer's norm."""
        cols = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        return seen[f"z{l}"][..., cols] @ self.layers[l].self_attn.o_proj.weight[:, cols].T

    def share(self, seen: dict[str, Tensor], l: int, h: int) -> Tensor:
        norm, a = self.layers[l].post_attention_layernorm, seen[f"A{l}"]
        return (1 + norm.weight) * self.r(seen, l, h) * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + norm.eps)

    def delta(self, sender: str, rule: str, linear: bool = False) -> Tensor:
        """What one edge from `sender` adds to its receiver; `linear`: the difference EAP multiplies."""
        clean, corrupt = self.clean, self.corrupt
        if not sender.startswith("a"):
            return corrupt[sender] - clean[sender]
        l, h = (int(part[1:]) for part in sender.split("."))
        if rule == "shares":
            return self.share(corrupt, l, h) - self.share(clean, l, h)
        change = self.r(corrupt, l, h) - self.r(clean, l, h)
        norm = self.layers[l].post_attention_layernorm
        return change if linear else norm(clean[f"A{l}"] + change) - norm(clean[f"A{l}"])

    def patched(self, receiver: str, delta: Tensor) -> Tensor:
        """The metric per prompt on the clean prompts with `receiver` alone reading its input + delta."""
        handles = []
        if receiver == "logits":
            handles.append(self.hf.model.norm.register_forward_pre_hook(lambda _m, a: (a[0] + delta,)))
        elif receiver.startswith("m"):
            block = self.layers[int(receiver[1:])]
            handles.append(block.pre_feedforward_layernorm.register_forward_pre_hook(lambda _m, a: (a[0] + delta,)))
        else:
            node, letter = receiver[:-1].split("<")
            l, head = int(node.split(".")[0][1:]), int(node.split(".")[1].lstrip("hkv"))
            block, kept = self.layers[l], {}
            proj = getattr(block.self_attn, f"{letter}_proj")
            cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)

            def edit(_m, _a, out: Tensor) -> Tensor:
                out = out.clone()
                # proj's own weights, not proj itself: calling it would run this hook again
                x = block.input_layernorm(kept["x"] + delta)
                out[..., cols] = torch.nn.functional.linear(x, proj.weight, proj.bias)[..., cols]
                return out

            def keep(_module, args, kwargs) -> None:
                kept["x"] = args[0] if args else kwargs["hidden_states"]

            handles += [
                block.register_forward_pre_hook(keep, with_kwargs=True),
                proj.register_forward_hook(edit),
            ]
        try:
            return self.forward(self.ids())
        finally:
            for handle in handles:
                handle.remove()

    @cached_property
    def clean_metric(self) -> Tensor:
        with torch.no_grad():
            return self.forward(self.ids())

    @cached_property
    def corrupt_metric(self) -> Tensor:
        with torch.no_grad():
            return self.forward(self.ids(corrupt=True))


def _build(family: str, tokenizer) -> Case:
    import transformers

    register_attention()
    torch.manual_seed(0)
    config_class = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}[family]
    cfg = config_class(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=50257,
        max_position_embeddings=64,
        sliding_window=4,
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="headlab").double().eval()
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            torch.nn.init.normal_(module.weight, 0.0, 0.5)
            module.forward = MethodType(_rms_norm_float64, module)
    hf.requires_grad_(False)
    model = hook_hf(hf, f"tiny-{family}", FAMILIES[family], tokenizer)
    task = build_task(compose(["task=ioi", f"task.n_prompts={N_PROMPTS}"]).task)
    return Case(hf, model, task, task.build(N_PROMPTS, 0, model))


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def case(request, gpt2_tokenizer) -> Case:
    return _build(request.param, gpt2_tokenizer)


RULES = pytest.mark.parametrize("rule", ["mib", "shares"])


def _close(got: float, want: float, scale: float, what: str) -> None:
    assert abs(got - want) <= TOL * scale, f"{what}: headlab {got!r} vs reference {want!r}"


# --- the senders ---------------------------------------------------------------------------------------


def test_the_senders_add_up_to_the_residual_stream(case):
    # shares: in the clean and the corrupted run alike, so the empty circuit can be the corrupted run
    graph = case.graph("shares")
    for inputs in (case.data.inputs, case.data.counterfactual):
        rec = record(case.model, graph, inputs)
        final = rec.trace.resid_final
        err = sender_outputs(case.model, graph, rec).sum(0) - final
        assert float(err.abs().max()) <= 1e-12 * float(final.abs().max())
    # mib: heads before their norm (summing to its input), the MLP after its own
    graph = case.graph("mib")
    rec, seen = record(case.model, graph, case.data.inputs), case.clean
    out = sender_outputs(case.model, graph, rec)
    for l in range(2):
        heads = out[graph.head_rows(l)]
        assert torch.allclose(heads.sum(0), seen[f"A{l}"], rtol=0, atol=1e-12)
        assert torch.allclose(heads[1], case.r(seen, l, 1), rtol=0, atol=1e-12)
        assert torch.allclose(out[graph.head_rows(l).stop], seen[f"m{l}"], rtol=0, atol=1e-12)


# --- exact edge patching, EAP --------------------------------------------------------------------------


@RULES
def test_exact_patching_equals_a_hand_patched_forward(case, rule):
    graph = case.graph(rule)
    which = torch.zeros_like(graph.real)
    for edge in SAMPLED:
        which[case.index(graph, edge)] = True
    kinds = {graph.receivers[j].kind for j in which.any(0).nonzero().flatten().tolist()}
    assert kinds == {"q", "k", "v", "mlp", "logits"}
    got = exact_scores(case.model, case.task, case.data, graph, which=which)
    want = {}
    with torch.no_grad():
        for edge in SAMPLED:
            sender, receiver = edge.split("->")
            want[edge] = float((case.patched(receiver, case.delta(sender, rule)) - case.clean_metric).mean())
    scale = max(abs(v) for v in want.values())
    assert scale > 1e-4
    for edge in SAMPLED:
        _close(float(got[case.index(graph, edge)]), want[edge], scale, edge)


@RULES
def test_eap_is_the_gradient_along_each_edges_difference(case, rule):
    """EAP's score is d/d eps of the metric with the receiver reading input + eps * difference: under shares the
    difference an edge's patch adds (EAP is exact patching's first-order term), under mib a head's difference
    before its layer's norm (MIB's code: the norm's Jacobian is not in the score)."""
    graph = case.graph(rule)
    got = scores(case.model, case.task, case.data, graph, "eap")
    want = {}
    for edge in SAMPLED:
        sender, receiver = edge.split("->")
        eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
        difference = case.delta(sender, rule, linear=True)
        with torch.enable_grad():
            (want[edge],) = torch.autograd.grad(case.patched(receiver, eps * difference).mean(), eps)
    scale = max(abs(float(v)) for v in want.values())
    assert scale > 1e-4
    for edge in SAMPLED:
        _close(float(got[case.index(graph, edge)]), float(want[edge]), scale, edge)
    if rule == "mib":  # a head's linear difference is not its patch: the two differ by the norm
        head_edge = SAMPLED[1].split("->")[0]
        assert not torch.allclose(case.delta(head_edge, "mib"), case.delta(head_edge, "mib", linear=True), atol=1e-3)


@RULES
def test_scores_with_nothing_forbidden_are_eaps_and_with_edges_forbidden_move(case, rule):
    """edges/rescore.py runs the circuit pass under autograd, the cut heads of a layer through its norm together
    under mib: with nothing forbidden it is EAP."""
    graph = case.graph(rule)
    real, want = graph.real, scores(case.model, case.task, case.data, graph, "eap")
    got = rescore.scores(case.model, case.task, case.data, graph, torch.zeros_like(real), "eap", prompts_per_pass=4)
    scale = float(want[real].abs().max())
    assert float((got[real] - want[real]).abs().max()) <= TOL * scale
    forbidden = graph.top_n(want, 8, prune=False)
    moved = rescore.scores(case.model, case.task, case.data, graph, forbidden, "eap", prompts_per_pass=4)
    allowed = real & ~forbidden
    assert torch.isnan(moved[forbidden]).all() and torch.isfinite(moved[allowed]).all()
    assert float((moved[allowed] - want[allowed]).abs().max()) > 1e-3 * scale


# --- circuits ------------------------------------------------------------------------------------------


@RULES
def test_the_full_circuit_is_the_clean_run_and_the_empty_one_the_corrupted_run(case, rule):
    graph = case.graph(rule)
    full = circuit_metric(case.model, case.task, case.data, graph, graph.real.clone())
    empty = circuit_metric(case.model, case.task, case.data, graph, torch.zeros_like(graph.real))
    scale = float(case.clean_metric.abs().max())
    assert float((case.clean_metric - case.corrupt_metric).abs().max()) > 1e-2
    assert float((full - case.clean_metric).abs().max()) <= TOL * scale
    assert float((empty - case.corrupt_metric).abs().max()) <= TOL * scale


@RULES
def test_the_circuit_without_one_edge_changes_the_metric_by_its_exact_score(case, rule):
    graph, edges = case.graph(rule), SAMPLED[::2]
    which = torch.zeros_like(graph.real)
    for edge in edges:
        which[case.index(graph, edge)] = True
    exact = exact_scores(case.model, case.task, case.data, graph, which=which)
    scale = float(exact[which].abs().max())
    for edge in edges:
        circuit = graph.real.clone()
        circuit[case.index(graph, edge)] = False
        change = float((circuit_metric(case.model, case.task, case.data, graph, circuit) - case.clean_metric).mean())
        _close(change, float(exact[case.index(graph, edge)]), scale, edge)


@RULES
def test_a_circuit_reads_no_sender_difference_before_it_is_written(case, rule):
    # the differences' buffer is reused uninitialised: a sender's row read before its layer runs (even times
    # zero) would carry whatever the memory held into the metric
    graph = case.graph(rule)
    circuit = graph.real & (torch.rand(graph.real.shape, generator=torch.Generator().manual_seed(0)) < 0.5)
    want = circuit_metric(case.model, case.task, case.data, graph, circuit)
    runs = clean_and_corrupted(case.model, graph, case.data)
    runs.scratch = torch.full_like(runs.corrupt_out, float("nan"))
    got = circuit_metric(case.model, case.task, case.data, graph, circuit, runs=runs)
    assert torch.isfinite(want).all() and torch.equal(got, want)


def test_under_mib_the_cut_heads_of_a_layer_pass_its_norm_together(case):
    # two heads of layer 0 cut from one receiver: it reads norm(A + both differences) - norm(A), no sum of two patches
    graph = case.graph("mib")
    receiver, heads = "a1.h0<q>", (1, 3)
    circuit = graph.real.clone()
    for h in heads:
        circuit[case.index(graph, f"a0.h{h}->{receiver}")] = False
    got = circuit_metric(case.model, case.task, case.data, graph, circuit)
    clean, corrupt = case.clean, case.corrupt
    norm, a = case.layers[0].post_attention_layernorm, clean["A0"]
    with torch.no_grad():
        both = sum(case.r(corrupt, 0, h) - case.r(clean, 0, h) for h in heads)
        want = case.patched(receiver, norm(a + both) - norm(a))
        summed = case.patched(receiver, sum(case.delta(f"a0.h{h}", "mib") for h in heads))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= TOL * scale
    assert float((summed - want).abs().max()) > 1e3 * TOL * scale  # the two readings differ


@RULES
def test_eap_ig_over_activations_runs_on_the_normalised_outputs(case, rule):
    graph = case.graph(rule)
    got = scores(case.model, case.task, case.data, graph, "eap_ig_activations", steps=2)
    assert not torch.isnan(got[graph.real]).any() and float(got[graph.real].abs().max()) > 0


@RULES
def test_a_circuit_without_every_edge_out_of_a_head_is_that_heads_node_patching(case, rule):
    # the head then has no edge out of it; under shares its value still sets its layer's norm scale, which
    # every head's share reads, so it must still read its own input
    graph = case.graph(rule)
    nodes = exact_node_scores(case.model, case.task, case.data, graph)
    names = [s.name for s in graph.senders]
    for sender in ("a0.h2", "a1.h1"):
        circuit = graph.real.clone()
        circuit[names.index(sender)] = False
        change = float((circuit_metric(case.model, case.task, case.data, graph, circuit) - case.clean_metric).mean())
        want = float(nodes[names.index(sender)])
        _close(change, want, abs(want), f"{rule} {sender}")


@RULES
def test_node_patching_adds_the_nodes_patch_at_its_normalised_output(case, rule):
    graph = case.graph(rule)
    got = exact_node_scores(case.model, case.task, case.data, graph)
    names, base = [s.name for s in graph.senders], case.clean_metric  # cached before any hook is on
    for sender in ("a0.h2", "a1.h1", "m0"):
        block = case.layers[int(sender[1])]
        if sender.startswith("m"):
            norm, patch = block.post_feedforward_layernorm, lambda _out: case.corrupt["m0"]
        else:
            delta = case.delta(sender, rule)
            norm, patch = block.post_attention_layernorm, lambda out, delta=delta: out + delta
        handle = norm.register_forward_hook(lambda _m, _a, out, patch=patch: patch(out))
        try:
            with torch.no_grad():
                want = float((case.forward(case.ids()) - base).mean())
        finally:
            handle.remove()
        _close(float(got[names.index(sender)]), want, abs(want), sender)


@RULES
def test_ungrouped_key_value_edges_add_up_to_the_grouped_ones(case, rule):
    # a key/value head's input gradient is the sum of its query heads' shares: EAP on the ungrouped graph summed
    # over a group is EAP on the grouped graph; cutting every query head's edge of a group is cutting the kv edge
    grouped = case.graph(rule)
    ungrouped = EdgeGraph.of(case.model, rule, kv_edges="ungrouped")
    assert ungrouped.expands_kv and ungrouped.n_edges == grouped.total(ungrouped=True)
    want = scores(case.model, case.task, case.data, grouped, "eap")
    got = scores(case.model, case.task, case.data, ungrouped, "eap")
    names = {r.name: j for j, r in enumerate(ungrouped.receivers)}
    heads = [f"a1.h{h}" for h in range(grouped.group)]  # the query heads of layer 1's kv head 0
    scale = float(want[grouped.real].abs().max())
    for letter in "kv":
        j = [r.name for r in grouped.receivers].index(f"a1.kv0<{letter}>")
        summed = sum(got[:, names[f"{h}<{letter}>"]] for h in heads)
        real = grouped.real[:, j]
        assert float((summed[real] - want[real, j]).abs().max()) <= 1e-9 * scale
    # the same cut, in either graph: every edge from a0.h1 into layer 1's kv head 0 (grouped) or its query heads
    cut_g = grouped.real.clone()
    cut_u = ungrouped.real.clone()
    s = [x.name for x in grouped.senders].index("a0.h1")
    for letter in "kv":
        cut_g[s, [r.name for r in grouped.receivers].index(f"a1.kv0<{letter}>")] = False
        for h in heads:
            cut_u[s, names[f"{h}<{letter}>"]] = False
    a = circuit_metric(case.model, case.task, case.data, grouped, cut_g)
    b = circuit_metric(case.model, case.task, case.data, ungrouped, cut_u)
    full = circuit_metric(case.model, case.task, case.data, grouped, grouped.real)
    assert float((a - b).abs().max()) <= 1e-9 * float(full.abs().max())
    assert float((a - full).abs().max()) > 1e-6  # the cut matters
