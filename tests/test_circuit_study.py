"""circuit=<method> end to end: the CLI run, its files (table, circuit.json, figures), the Python API,
and one-line refusals. The numbers themselves are checked against an independent computation in
test_edges.py; here the wiring is checked against the edges code it calls."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import headlab
from conftest import error_line, run_headlab
from headlab.edges.eap import scores
from headlab.edges.graph import EdgeGraph


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir_with_tokenizer):
    """The tiny random GPT-2 with the real tokenizer beside it, as a user's saved model would be."""
    return tiny_hf_dir_with_tokenizer("gpt2")


def test_cli_run_writes_scores_faithfulness_json_and_figures(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_headlab(
        "run",
        "model=hf",
        f"model.path={model_dir}",
        "task=ioi",
        "task.n_prompts=8",
        "circuit=eap",
        "circuit.fractions=[0.01,0.1,0.5,1.0]",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    table = pd.read_parquet(run_dir / "results.parquet")
    edges = table[table.intervention == "edge"]
    model = headlab.load_model(str(model_dir))
    graph = EdgeGraph.of(model)
    # 3 layers x 4 heads: q, k, v of layer l read 1 + 5l senders, its MLP 5 + 5l, the logits all 16
    assert len(edges) == graph.n_edges == 12 * (1 + 6 + 11) + (5 + 10 + 15) + 16
    # the table's scores are the edges code's on the same prompts
    task = headlab.load_task("ioi", n_prompts=8)
    expected = scores(model, task, task.build(8, 20_000, model), graph, "eap")
    by_name = dict(zip(graph.edge_names(), expected[graph.real].tolist()))
    got = dict(zip(edges.edge, edges.value))
    assert max(abs(got[k] - by_name[k]) for k in by_name) < 1e-6
    curve = table[(table.intervention == "circuit") & (table.metric == "faithfulness")]
    assert sorted(curve.fraction.unique()) == [0.01, 0.1, 0.5, 1.0]
    assert curve[curve.fraction == 1.0].value.tolist() == pytest.approx([1.0, 1.0], abs=1e-5)
    document = json.loads((run_dir / "circuit.json").read_text())
    assert set(document) == {"cfg", "nodes", "edges"} and len(document["edges"]) == graph.n_edges
    target = int(table[table.metric == "target_edges"].value.iloc[0])
    assert sum(e["in_graph"] for e in document["edges"].values()) == target == int(edges.in_circuit.sum())
    assert (run_dir / "figures" / "circuit_eap.png").stat().st_size > 10_000
    assert (run_dir / "figures" / "faithfulness.png").is_file()


def test_api_nodes_exact_sum_to_patching_each_node(model_dir):
    model = headlab.load_model(str(model_dir))
    task = headlab.load_task("ioi", n_prompts=6)
    nodes = headlab.circuit(model, task, method="exact", level="nodes")
    assert list(nodes.node[:2]) == ["input", "a0.h0"] and (nodes.intervention == "node").all()
    # the input node patched = the whole corrupted run: its score is corrupted minus clean
    data = task.build(6, 20_000, model)
    with torch.no_grad():
        clean = task.per_prompt(model.readout(model.forward_blocks(data.inputs), data.positions), data)[:, 0]
        corrupt = task.per_prompt(model.readout(model.forward_blocks(data.counterfactual), data.positions), data)[:, 0]
    assert nodes.value.iloc[0] == pytest.approx(float((corrupt - clean).mean()), abs=1e-5)


def test_task_without_counterfactuals_or_smooth_metric_is_refused_in_one_line(demo_root):
    result = run_headlab("run", "circuit=eap", cwd=demo_root)
    assert result.returncode != 0
    assert "smooth metric" in error_line(result)


def test_unknown_circuit_method_is_refused(tmp_path):
    result = run_headlab("run", "circuit=acdc", cwd=tmp_path)
    assert result.returncode == 2
    # circuit=<method> is study=circuit study.method=<method>: the method's words are named
    assert "study.method=acdc: expected one of eap, eap_ig, eap_ig_activations, exact" in error_line(result)


def test_a_circuit_method_added_from_outside_is_one_record(model_dir, monkeypatch):
    """A method registered beside headlab's (edges/methods.py's records) runs through study=circuit end to
    end: here EAP's scores with their sign flipped, so its circuit holds the edges EAP ranks last."""
    from headlab.edges import methods

    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    eap = methods.METHODS["eap"]
    flipped = methods.Method(
        "flipped_eap",
        "EAP with its sign flipped",
        "none: a test's method",
        "headlab's own eap record",
        "this test",
        lambda *args: -eap.edges(*args),
        lambda *args: -eap.nodes(*args),
    )
    methods.register(flipped)
    with pytest.raises(headlab.UsageError, match="flipped_eap is taken"):
        methods.register(flipped)
    model = headlab.load_model(str(model_dir))
    task = headlab.load_task("ioi", n_prompts=6)
    mine = headlab.circuit(model, task, method="flipped_eap", faithfulness=False)
    theirs = headlab.circuit(model, task, method="eap", faithfulness=False)
    got, want = (t[t.intervention == "edge"].set_index("edge").value for t in (mine, theirs))
    assert set(mine.method.dropna()) == {"flipped_eap"} and len(got) == len(want)
    pd.testing.assert_series_equal(got, -want, check_names=False)
    from headlab.studies.circuit import summary

    summary(mine, 5)  # a table without the faithfulness curve prints its edges alone
    nodes = headlab.circuit(model, task, method="flipped_eap", level="nodes")
    assert (nodes.intervention == "node").all()
    with pytest.raises(headlab.UsageError, match="study.method=nope: expected one of eap, eap_ig"):
        headlab.circuit(model, task, method="nope")
