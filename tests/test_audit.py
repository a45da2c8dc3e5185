"""study=audit (edges/audit.py, edges/hypothesis.py): Shi et al.'s statistics against independent
computations, and the whole audit on hand-set transformers whose circuit is known.

The hand-set models are GPT-2-shaped (2 layers, 4 heads of 16, the real GPT-2 tokenizer, IOI prompts):
every head's output and every MLP's scaled by 0.05 (small noise), and head a1.h2 set to copy: its query
and key weights zero (uniform attention over the prompt), its value a random 16-dimensional projection P
and its output 30 P^T. IOI's logit difference then moves between the clean and the ABC prompts through
that head's values and output alone, so the circuit is the two edges input->a1.h2<v> and a1.h2->logits.
The rival model adds a1.h3, an exact copy of a1.h2, each at half the output: the two heads' paths are
equally faithful (0.5 each) by symmetry, and share no edge.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import binomtest

import headlab
from conftest import error_line, run_headlab
from headlab.edges import hypothesis
from headlab.edges.audit import Units, jaccard, rivals
from headlab.edges.eap import scores as eap_scores
from headlab.edges.faithfulness import Evaluator
from headlab.edges.graph import EdgeGraph
from headlab.edges.rescore import scores as rescore_scores
from headlab.models.families import FAMILIES
from headlab.models.hf import hook_hf, register_attention

D, HEADS, D_HEAD = 64, 4, 16
PLANTED = {"input->a1.h2<v>", "a1.h2->logits"}
TWIN = {"input->a1.h3<v>", "a1.h3->logits"}
QUICK = dict(n_prompts=16, held_out=16, n_random=30, permutations=300, resamples=3, draws=1)


pytestmark = pytest.mark.usefixtures("one_thread")


def planted(gpt2_tokenizer, rival: bool, noise: float = 0.05, scale: float = 30.0):
    from transformers import AutoModelForCausalLM, GPT2Config

    register_attention()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=HEADS, n_embd=D, vocab_size=50257, n_positions=64)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="headlab").eval()
    with torch.no_grad():
        for block in hf.transformer.h:
            for proj in (block.mlp.c_proj, block.attn.c_proj):
                proj.weight.mul_(noise)
                proj.bias.zero_()
        attn = hf.transformer.h[1].attn
        p = torch.linalg.qr(torch.randn(D, D_HEAD))[0]  # [d_model, d_head]
        for h in [2, 3] if rival else [2]:
            head = slice(h * D_HEAD, (h + 1) * D_HEAD)
            for part in (0, 1):  # query and key: zero, so the head attends evenly
                attn.c_attn.weight[:, part * D + h * D_HEAD : part * D + (h + 1) * D_HEAD] = 0
                attn.c_attn.bias[part * D + h * D_HEAD : part * D + (h + 1) * D_HEAD] = 0
            attn.c_attn.weight[:, 2 * D + h * D_HEAD : 2 * D + (h + 1) * D_HEAD] = p
            attn.c_attn.bias[2 * D + h * D_HEAD : 2 * D + (h + 1) * D_HEAD] = 0
            attn.c_proj.weight[head, :] = scale * p.T / (2 if rival else 1)
    return hook_hf(hf, "planted-rival" if rival else "planted", FAMILIES["gpt2"], gpt2_tokenizer)


@pytest.fixture(scope="module")
def unique(gpt2_tokenizer):
    return planted(gpt2_tokenizer, rival=False)


@pytest.fixture(scope="module")
def twins(gpt2_tokenizer):
    return planted(gpt2_tokenizer, rival=True)


def _audit(model, **options) -> pd.DataFrame:
    return headlab.study(model, headlab.load_task("ioi"), "audit", **{**QUICK, **options})


def _value(df: pd.DataFrame, metric: str, variant: str | None = None) -> pd.Series:
    rows = df[(df.intervention == "audit") & (df.metric == metric)]
    if variant is not None:
        rows = rows[rows.variant == variant]
    (row,) = [r for _, r in rows.iterrows()]
    return row


def _circuit(df: pd.DataFrame) -> set[str]:
    shares = df[df.intervention == "keep_share"]
    return set(shares[shares.in_circuit.astype(bool)].unit)


# ---------------------------------------------------------------- the statistics


def test_equivalence_p_value_is_the_binomial_tail_of_the_papers_statistic():
    rng = np.random.default_rng(0)
    model, circuit = rng.normal(size=40), rng.normal(size=40)
    out = hypothesis.equivalence(model, circuit, epsilon=0.1)
    share = float((circuit > model).mean())
    t_obs, n = abs(share - 0.5), 40
    by_hand = sum(math.comb(n, k) * 0.6**k * 0.4 ** (n - k) for k in range(n + 1) if abs(k / n - 0.5) >= t_obs - 1e-12)
    assert out.statistic == share and out.p_value == pytest.approx(by_hand, rel=1e-9)
    # a circuit that always underperforms is not equivalent; one that wins half the prompts is
    assert hypothesis.equivalence(model, model - 1.0).rejected
    alternating = model + np.where(np.arange(40) % 2 == 0, 0.1, -0.1)
    assert not hypothesis.equivalence(model, alternating).rejected


def test_hsic_is_the_trace_of_the_centred_kernels_and_its_permutation_test_tells_dependence():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=30), rng.normal(size=30)
    sigma = 0.7
    k = np.array([[math.exp(-((a - b) ** 2) / (2 * sigma**2)) for b in x] for a in x])
    l = np.array([[math.exp(-((a - b) ** 2) / (2 * sigma**2)) for b in y] for a in y])  # noqa: E741
    centred = lambda m: m - m.mean(0) - m.mean(1)[:, None] + m.mean()  # noqa: E731  H m H
    assert hypothesis.hsic(x, y, sigma) == pytest.approx(np.sum(centred(k) * centred(l)) / 29**2, rel=1e-10)
    assert not hypothesis.independence(x, y, 500, seed=0).rejected
    assert hypothesis.independence(x, x**2 + 0.05 * y, 500, seed=0).rejected


def test_minimality_counts_the_random_effects_each_unit_beats_and_bonferronis_the_least_p():
    rng = np.random.default_rng(2)
    circuit = rng.normal(size=20)
    knocked = np.stack([circuit + 3.0, circuit + 0.01])  # one unit that matters, one that does not
    with_random = circuit[None, :] + rng.normal(scale=0.1, size=(50, 20))
    out = hypothesis.minimality(circuit, knocked, with_random, quantile=0.9)
    effects = ((circuit - knocked) ** 2).mean(1)
    randoms = ((with_random - circuit) ** 2).mean(1)
    counts = [(e > randoms).sum() for e in effects]
    assert counts[0] == 50 and counts[1] < 5
    expected = [binomtest(int(c), 50, 0.9, alternative="less").pvalue for c in counts]
    assert out.p_values.tolist() == pytest.approx(expected)
    assert out.outcome.p_value == pytest.approx(min(1.0, 2 * min(expected))) and out.outcome.rejected


def test_units_of_heads_cut_every_outgoing_edge_of_the_heads_left_out(unique):
    graph = EdgeGraph.of(unique)
    units = Units(graph, "heads")
    chosen = torch.tensor([n == "a1.h2" for n in units.names])
    mask = units.to_mask(chosen)
    names = graph.edge_names(mask)
    assert "a1.h2->logits" in names and "input->logits" in names and "m0->logits" in names
    assert not any(n.startswith(("a0.", "a1.h0", "a1.h1", "a1.h3")) for n in names)
    assert torch.equal(units.of_mask(mask), chosen) and jaccard(chosen, chosen) == 1.0


# ---------------------------------------------------------------- the audit on hand-set models


def test_the_planted_circuit_is_found_stable_unique_equivalent_and_minimal(unique):
    df = _audit(unique)
    assert _circuit(df) == PLANTED
    assert _value(df, "faithfulness", "found").value == pytest.approx(1.0, abs=0.01)
    for kind in ("resample", "seed", "templates", "method", "steps"):
        assert df[(df.metric == "jaccard_mean") & (df.kind == kind)].value.iloc[0] == 1.0
    best = _value(df, "margin")
    assert best.ci_low > 0.9  # every disjoint rival recovers nothing: unique at its size
    assert not _value(df, "equivalence_p").rejected
    assert not _value(df, "minimality_p").rejected
    # the rest of the model reads the same prompt tokens: its scores still move with the model's
    assert _value(df, "independence_p").rejected


def test_the_circuit_study_and_the_audit_find_one_smallest_circuit(unique):
    """Both search circuits of k edges (EdgeGraph.top_pruned) by one bisection (faithfulness.reaching): the
    circuit study's smallest circuit reaching the target is the audit's found circuit."""
    edges = headlab.circuit(unique, headlab.load_task("ioi"), n_prompts=16, exact_check=0, n_boot=0)
    rows = edges[edges.intervention == "edge"]
    in_circuit = rows[rows.in_circuit.fillna(False).astype(bool)]
    assert set(in_circuit.edge) == PLANTED
    target = edges[(edges.intervention == "circuit") & (edges.metric == "target_edges")].value
    assert int(target.iloc[0]) == len(PLANTED)
    graph = EdgeGraph.of(unique)
    scores = torch.rand(graph.real.shape, generator=torch.Generator().manual_seed(0))
    ranking = graph.ranking(scores)

    def prefix(m: int) -> torch.Tensor:
        mask = torch.zeros_like(graph.real)
        mask.view(-1)[ranking[:m]] = True
        return graph.prune(mask)

    for k in (1, 5, 40):
        # the shortest prefix of the ranking that prunes to k edges or more, found by a scan (an edge added
        # never prunes one that survived, so pruned sizes rise with the prefix and bisection finds it too)
        m = next(m for m in range(k, len(ranking) + 1) if int(prefix(m).sum()) >= k)
        assert graph.top_pruned(scores, k).equal(prefix(m)) and int(prefix(m).sum()) >= k


def test_a_random_circuit_of_the_same_size_is_rejected(unique, tmp_path):
    graph = EdgeGraph.of(unique)
    names = graph.edge_names()
    mask = torch.zeros_like(graph.real)
    flat = graph.real.flatten().nonzero().flatten()
    picks = [i for i in np.random.default_rng(1).permutation(len(names)) if "a1.h2" not in names[i]][:2]
    mask.view(-1)[flat[picks]] = True
    path = tmp_path / "random.json"
    path.write_text(json.dumps(graph.to_json(torch.zeros(graph.real.shape), mask)))
    df = _audit(unique, circuit=str(path), resamples=0, draws=0, templates=False, methods=["eap"])
    assert _value(df, "faithfulness", "found").value == pytest.approx(0.0, abs=0.01)
    assert _value(df, "equivalence_p").rejected and _value(df, "minimality_p").rejected


def test_a_planted_twin_is_found_as_an_equally_faithful_disjoint_rival(twins):
    df = _audit(twins, target=0.45)
    found = _circuit(df)
    assert found in (PLANTED, TWIN)
    assert _value(df, "faithfulness", "found").value == pytest.approx(0.5, abs=0.05)
    rival = _value(df, "faithfulness", "rival_1")
    assert rival.value == pytest.approx(_value(df, "faithfulness", "found").value, abs=1e-6)
    assert _value(df, "shared_units", "rival_1").value == 0
    best = _value(df, "margin")
    assert best.ci_low <= 0 <= best.ci_high  # neither is unique
    assert _value(df, "equivalence_p").rejected  # half the effect is not the model


def test_each_rival_round_is_scored_with_the_found_circuit_and_every_earlier_rival_forbidden(twins):
    task = headlab.load_task("ioi")
    data = task.build(8, 0, twins)
    graph = EdgeGraph.of(twins)
    units = Units(graph, "edges")
    found = torch.tensor([n in PLANTED for n in units.names])
    seen: list[torch.Tensor] = []

    def rescore(forbidden: torch.Tensor) -> torch.Tensor:
        seen.append(forbidden.clone())
        return units.scores(rescore_scores(twins, task, data, graph, units.edges_of(forbidden), "eap"))

    cut_scores = units.scores(eap_scores(twins, task, data, graph, "eap"))
    out = rivals(units, cut_scores, found, Evaluator(twins, task, data, graph), 2, rescore, cut=False)
    assert torch.equal(seen[0], found) and torch.equal(seen[1], found | out[0].chosen)
    assert [r.scores for r in out] == ["rescored", "rescored"]
    # with the planted head's path forbidden its twin's carries the effect alone, and is the first rival
    assert {units.names[i] for i in out[0].chosen.nonzero().flatten().tolist()} == TWIN
    assert out[0].faithfulness == pytest.approx(0.5, abs=0.05) and out[1].faithfulness == pytest.approx(0, abs=0.05)
    # the two paths add (through the final norm alone): forbidding one moves the other's scores by a few percent
    twin = torch.tensor([n in TWIN for n in units.names])
    again = rescore(found)
    assert torch.allclose(again[twin], cut_scores[twin], rtol=0.05) and not torch.equal(again[twin], cut_scores[twin])


def test_each_round_keeps_the_more_faithful_of_the_cut_and_the_rescored_rival(twins):
    # the twin toy's found circuit is the planted head's path; its twin's path is the best rival either way
    task = headlab.load_task("ioi")
    data = task.build(8, 0, twins)
    graph = EdgeGraph.of(twins)
    units, ev = Units(graph, "edges"), Evaluator(twins, task, data, graph)
    found = torch.tensor([n in PLANTED for n in units.names])
    twin = torch.tensor([n in TWIN for n in units.names])
    # a rescoring that points away from the twin: the cut scores' rival (the twin's path) is kept
    misled = torch.where(twin | found, 0.0, torch.rand(units.count, dtype=torch.float64))
    cut_scores = units.scores(eap_scores(twins, task, data, graph, "eap"))
    both = rivals(units, cut_scores, found, ev, 1, lambda forbidden: misled)
    assert both[0].scores == "cut" and torch.equal(both[0].chosen, twin)
    alone = rivals(units, cut_scores, found, ev, 1, lambda forbidden: misled, cut=False)
    assert alone[0].scores == "rescored" and alone[0].faithfulness < both[0].faithfulness - 0.4


def test_rivals_are_cut_from_the_found_scores_where_asked_or_where_the_method_cannot_forbid(unique):
    quick = dict(resamples=0, draws=0, templates=False, methods=["eap"], twice_the_steps=False, at_target=False)
    asked = _audit(unique, rival_scores="cut", **quick)
    cannot = _audit(unique, method="eap_ig_activations", steps=2, **quick)
    rescored = _audit(unique, rival_scores="rescored", **quick)
    for df, how in ((asked, {"cut"}), (cannot, {"cut"}), (rescored, {"rescored"})):
        assert set(df[df.kind == "rival"].rival_scores) == how
    both = _audit(unique, **quick)  # the default: each round's rival from whichever scores gave the better one
    assert set(both[both.kind == "rival"].rival_scores) <= {"cut", "rescored"}


def test_cli_audits_a_circuit_run_on_its_model_and_task(tiny_hf_dir_with_tokenizer, tmp_path):
    model_dir = tiny_hf_dir_with_tokenizer("gpt2")
    circuit_run = tmp_path / "circuit"
    common = ("task.n_prompts=8",)
    found = run_headlab(
        "run", "model=hf", f"model.path={model_dir}", "task=ioi", *common, "circuit=eap",
        f"hydra.run.dir={circuit_run}", cwd=tmp_path,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    audit_run = tmp_path / "audit"
    audited = run_headlab(
        "audit", str(circuit_run), "study.held_out=8", "study.n_random=10", "study.permutations=100",
        "study.resamples=2", "study.draws=0", f"hydra.run.dir={audit_run}", cwd=tmp_path,
    )  # fmt: skip
    assert audited.returncode == 0, audited.stderr
    table = pd.read_parquet(audit_run / "results.parquet")
    document = json.loads((circuit_run / "circuit.json").read_text())
    in_graph = {name for name, e in document["edges"].items() if e["in_graph"]}
    assert _circuit(table) == in_graph
    meta = json.loads((audit_run / "meta.json").read_text())
    assert meta["circuit"].endswith("circuit.json") and set(meta["tests"]) == {
        "equivalence",
        "independence",
        "minimality",
    }
    # the circuit run's method is the audit's, and its rivals were scored again with the circuit forbidden
    assert (table[table.intervention == "audit"].method == "eap").all()
    assert meta["rival_scores"] == "both"
    for name in ("audit_overlap", "audit_faithfulness", "audit_tests"):
        assert (audit_run / "figures" / f"{name}.png").stat().st_size > 5_000
    refused = run_headlab("audit", str(tmp_path), cwd=tmp_path)
    assert refused.returncode != 0 and "not a headlab run dir" in error_line(refused)
