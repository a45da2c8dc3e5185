"""Circuit reuse (analysis/reuse.py, headlab.reuse, `headlab reuse`): the overlap of two tasks' important
heads against counts and probabilities computed by hand, circuits read from their edges, and the CLI on
two real sweeps."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import headlab
from conftest import error_line, run_headlab
from headlab import results

LAYERS, HEADS = 3, 4


def sweep_table(task: str, effects: np.ndarray, metric: str = "ld", seeds: tuple[int, ...] = (0,)) -> pd.DataFrame:
    """A zero-ablation head sweep whose head (l, h) moves `metric` by effects[l, h] from clean 2.0."""
    rows = []
    for seed in seeds:
        rows.append(dict(seed=seed, intervention="none", method="none", metric=metric, value=2.0))
        for (l, h), e in np.ndenumerate(effects):
            rows.append(dict(seed=seed, intervention="ablate_head", method="zero", layer=l, head=h, metric=metric))
            rows[-1]["value"] = 2.0 + e
    return results.conform(pd.DataFrame(rows).assign(experiment="x", model="m", task=task, n=10))


def hypergeometric_tail(shared: int, total: int, k_a: int, k_b: int) -> float:
    """P(at least `shared` of k_b draws land among the k_a marked, out of `total`), by counting."""
    ways = sum(math.comb(k_a, s) * math.comb(total - k_a, k_b - s) for s in range(shared, min(k_a, k_b) + 1))
    return ways / math.comb(total, k_b)


def numbers(table: pd.DataFrame) -> dict[str, float]:
    rows = table[table["intervention"] == "reuse"]
    return dict(zip(rows["metric"], rows["value"]))


def test_overlap_of_top_heads_equals_the_count_by_hand():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(LAYERS, HEADS))
    b = rng.normal(size=(LAYERS, HEADS))
    k = 4
    table = headlab.reuse(sweep_table("t1", a), sweep_table("t2", b), k=k)
    top_a = set(np.argsort(-np.abs(a).ravel())[:k])
    top_b = set(np.argsort(-np.abs(b).ravel())[:k])
    shared, total = len(top_a & top_b), LAYERS * HEADS
    got = numbers(table)
    assert got["shared_heads"] == shared
    assert got["jaccard"] == pytest.approx(shared / len(top_a | top_b))
    assert got["expected_shared_by_chance"] == pytest.approx(k * k / total)
    assert got["p_value"] == pytest.approx(hypergeometric_tail(shared, total, k, k))
    ranks_a, ranks_b = (np.argsort(np.argsort(np.abs(x).ravel())) for x in (a, b))
    assert got["spearman_importance"] == pytest.approx(np.corrcoef(ranks_a, ranks_b)[0, 1])
    assert got["pearson_effect"] == pytest.approx(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    heads = table[table["side"] == "a"].sort_values(["layer", "head"])
    assert heads["value"].to_numpy() == pytest.approx(a.ravel())
    assert set(np.flatnonzero(heads["important"].to_numpy())) == top_a


def test_the_same_heads_in_two_tasks_share_everything_and_effects_average_over_seeds():
    a = np.arange(LAYERS * HEADS, dtype=float).reshape(LAYERS, HEADS)
    two_seeds = pd.concat([sweep_table("t1", a, seeds=(0,)), sweep_table("t1", 3 * a, seeds=(1,))])
    table = headlab.reuse(two_seeds, sweep_table("t2", -a), k=3)
    got = numbers(table)
    assert (got["shared_heads"], got["jaccard"]) == (3, 1.0)
    assert got["p_value"] == pytest.approx(1 / math.comb(LAYERS * HEADS, 3))
    assert table[(table["side"] == "a") & (table["layer"] == 2) & (table["head"] == 3)]["value"].item() == 22.0


def circuit_table(task: str, chosen: set[str]) -> pd.DataFrame:
    every = ["input->a0.h1<q>", "a0.h1->a1.h2<k>", "a0.h0->a2.h3<v>", "a1.h2->logits", "a2.h3->logits", "m1->logits"]
    rows = [dict(intervention="edge", method="eap", edge=e, in_circuit=e in chosen, value=1.0) for e in every]
    return results.conform(pd.DataFrame(rows).assign(experiment="c", model="m", task=task, seed=0, metric="ld", n=1))


def test_circuits_compare_the_heads_their_edges_touch_and_the_edges_themselves():
    first = circuit_table("t1", {"input->a0.h1<q>", "a0.h1->a1.h2<k>", "a1.h2->logits"})  # heads 0.1, 1.2
    second = circuit_table("t2", {"a0.h0->a2.h3<v>", "a1.h2->logits", "m1->logits"})  # heads 0.0, 2.3, 1.2
    got = numbers(headlab.reuse(first, second))
    assert (got["k_a"], got["k_b"], got["shared_heads"]) == (2, 3, 1)
    assert got["n_heads"] == 3 * 4  # layers 0..2, heads 0..3 named by the edges
    assert got["edge_jaccard"] == pytest.approx(1 / 5)
    assert got["p_value"] == pytest.approx(hypergeometric_tail(1, 12, 2, 3))


def test_bad_input_is_refused_in_one_line():
    a = sweep_table("t1", np.ones((LAYERS, HEADS)))
    with pytest.raises(headlab.UsageError, match="differ in shape"):
        headlab.reuse(a, sweep_table("t2", np.ones((2, HEADS))))
    two_metrics = pd.concat([a, sweep_table("t1", np.ones((LAYERS, HEADS)), metric="acc")])
    with pytest.raises(headlab.UsageError, match="several metrics; choose one with --metric: ld, acc"):
        headlab.reuse(two_metrics, a)
    with pytest.raises(headlab.UsageError, match="no head rows"):
        headlab.reuse(a[a["intervention"] == "none"], a)


def test_cli_compares_two_real_sweeps_and_draws_the_figure(demo_root, trained_count01, tmp_path):
    dirs = {}
    for method in ("zero", "mean"):
        dirs[method] = tmp_path / method
        done = run_headlab(
            "run", f"output.root={demo_root}", f"ablate.method={method}", f"hydra.run.dir={dirs[method]}", cwd=demo_root
        )
        assert done.returncode == 0, done.stderr
    out = tmp_path / "reuse"
    done = run_headlab(
        "reuse",
        str(dirs["zero"]),
        str(dirs["mean"]),
        "--k",
        "2",
        "--metric",
        "logit_diff",
        "-o",
        str(out),
        cwd=demo_root,
    )
    assert done.returncode == 0, done.stderr
    assert "shared_heads" in done.stdout
    table = pd.read_parquet(out / "results.parquet")
    zero, mean = (pd.read_parquet(dirs[m] / "results.parquet") for m in ("zero", "mean"))
    top = []
    for sweep in (zero, mean):
        acc = sweep[sweep["metric"] == "logit_diff"]
        clean = acc[acc["intervention"] == "none"]["value"].item()
        heads = acc[acc["intervention"] == "ablate_head"]
        heads = heads.assign(e=(heads["value"] - clean).abs())
        top.append(set(heads.nlargest(2, "e")[["layer", "head"]].itertuples(index=False, name=None)))
    assert numbers(table)["shared_heads"] == len(top[0] & top[1])
    assert (out / "figures" / "reuse.png").stat().st_size > 10_000
    bad = run_headlab("reuse", str(dirs["zero"]), str(tmp_path / "missing"), cwd=demo_root)
    assert bad.returncode != 0 and len(error_line(bad)) < 200
