"""The default layer x head heatmaps (figures/heads.py, their numbers from tables.py): numbers from a
hand-built table, the PNGs, and the demo run drawing them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import run_headlab
from headlab import results, tables
from headlab.figures import FIGURES, heads

LAYERS, HEADS = 2, 3
ZERO = "ablate_head zero"
PATCH_Q = "patch_head activation, site q, at END"


def effect(seed: int, metric: str, panel: str, layer: int, head: int) -> float:
    """The planted effect of one head: distinct per cell, seed, metric and panel."""
    sign = -1 if panel == ZERO else 1
    return sign * (0.1 * layer + 0.01 * head + 0.001 * seed) * (10 if metric == "ld" else 1)


def hand_table() -> pd.DataFrame:
    """Two seeds, two metrics, zero ablation and q patching at END of every head, plus rows that are not
    one head's effect (per-prompt, a head swap, a layer ablation, head scores) with values that would show."""
    rows = []
    for seed, clean in ((0, {"acc": 0.9, "ld": 3.0}), (1, {"acc": 0.8, "ld": 5.0})):
        for metric, c in clean.items():
            rows.append(dict(seed=seed, intervention="none", method="none", metric=metric, value=c))
            panels = ((ZERO, {"intervention": "ablate_head", "method": "zero"}),)
            panels += ((PATCH_Q, {"intervention": "patch_head", "method": "activation", "site": "q", "token": "END"}),)
            for panel, label in panels:
                for l in range(LAYERS):
                    for h in range(HEADS):
                        if panel == PATCH_Q and (l, h) == (1, 2):
                            continue  # a head the patching sweep left out: NaN in its grid
                        v = c + effect(seed, metric, panel, l, h)
                        rows.append(dict(seed=seed, **label, layer=l, head=h, metric=metric, value=v))
                        rows[-1].update(ci_low=v - 0.02, ci_high=v + 0.03)
            for extra in (
                dict(intervention="ablate_head", method="zero", layer=0, head=0, prompt_id=3),
                dict(intervention="pattern_from", method="zero", layer=0, head=0, other_head=1),
                dict(intervention="ablate_layer", method="zero", layer=0),
                dict(intervention="none", method="score", layer=0, head=1),
            ):
                rows.append(dict(seed=seed, **extra, metric=metric, value=99.0))
    return results.conform(pd.DataFrame(rows).assign(experiment="hand", model="toy", task="count", n=64))


def test_effects_are_value_less_clean_of_the_same_seed_averaged_over_seeds():
    cells = tables.effects(hand_table())
    assert list(cells["panel"].unique()) == [ZERO, PATCH_Q]
    for metric in ("acc", "ld"):
        for panel in (ZERO, PATCH_Q):
            rows = cells[(cells["metric"] == metric) & (cells["panel"] == panel)]
            expected = np.array(
                [
                    [np.mean([effect(s, metric, panel, l, h) for s in (0, 1)]) for h in range(HEADS)]
                    for l in range(LAYERS)
                ]
            )
            if panel == PATCH_Q:
                expected[1, 2] = np.nan
            got = tables.grid(rows, size=(LAYERS, HEADS)).to_numpy(float)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    one = cells[(cells["metric"] == "ld") & (cells["panel"] == ZERO) & (cells["layer"] == 1) & (cells["head"] == 2)]
    row = one.iloc[0]
    by_seed = [effect(s, "ld", ZERO, 1, 2) for s in (0, 1)]
    assert row["n_seeds"] == 2 and row["clean"] == pytest.approx(4.0)
    assert (row["seed_low"], row["seed_high"]) == pytest.approx((min(by_seed), max(by_seed)))
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((np.mean(by_seed) - 0.02, np.mean(by_seed) + 0.03))


def test_draw_writes_one_png_per_metric_and_returns_the_strongest_head(tmp_path):
    numbers = heads.draw(hand_table(), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["heads_acc.png", "heads_ld.png"]
    assert all(p.stat().st_size > 10_000 for p in tmp_path.glob("*.png"))
    strongest = np.mean([effect(s, "ld", ZERO, 1, 2) for s in (0, 1)])  # |zero| > |patch|: (1, 2) unpatched
    assert numbers["top_head_ld"] == "L1H2" and numbers["top_effect_ld"] == pytest.approx(strongest)
    assert numbers["top_panel_ld"] == ZERO
    assert json.loads(json.dumps(numbers)) == numbers


@pytest.mark.parametrize(
    "rows",
    [
        dict(intervention="edge", method="eap", edge="a0.h1->logits", metric="logit_diff", value=1.0),
        dict(intervention="none", method="sae", layer=0, feature=7, metric="l0", value=3.0),
        dict(intervention="ablate_layer", method="zero", layer=0, metric="acc", value=0.5),
    ],
    ids=["circuit", "sae", "layers"],
)
def test_tables_without_head_rows_draw_nothing(tmp_path, rows):
    table = results.conform(pd.DataFrame([rows]).assign(experiment="e", model="m", task="t", seed=0, n=1))
    assert heads.draw(table, tmp_path / "figures") == {}
    assert not (tmp_path / "figures").exists()


def test_the_plain_sweep_draws_heads_by_default():
    from headlab.studies import sweep

    assert sweep.STUDY.figures == "heads" and "heads" in FIGURES


def test_demo_run_writes_a_heatmap_per_metric(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "figures").mkdir(parents=True)
    (run_dir / "figures" / "numbers.json").write_text('{"stale": 1}')  # an earlier config's numbers
    args = ("run", f"output.root={demo_root}", "task.n_prompts=32", "output.n_boot=20", f"hydra.run.dir={run_dir}")
    result = run_headlab(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = pd.read_parquet(run_dir / "results.parquet")
    metrics = sorted(table["metric"].unique())
    assert sorted(p.name for p in (run_dir / "figures").glob("*.png")) == [f"heads_{m}.png" for m in metrics]
    numbers = json.loads((run_dir / "figures" / "numbers.json").read_text())
    assert "stale" not in numbers
    cells = tables.effects(table)
    for m in metrics:
        of_metric = cells[cells["metric"] == m]
        top = of_metric.loc[of_metric["effect"].abs().sort_values(ascending=False, kind="stable").index[0]]
        assert numbers[f"top_head_{m}"] == f"L{top['layer']}H{top['head']}"
        assert numbers[f"top_effect_{m}"] == pytest.approx(top["effect"])
