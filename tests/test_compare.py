"""headlab compare: one study on several models, one row per model and head class, checked against counts
made straight from the runs' tables (written as a sweep writes them), the figure, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import error_line, run_headlab
from headlab import compare, results
from headlab.multirun import STATUS, summarize
from headlab.studies.atlas_probes import rules
from headlab.studies.atlas_rules import labelled

PNG = b"\x89PNG\r\n\x1a\n"
# name -> (layers, heads): two models of different shapes, as smollm2-135m (30 x 9) and gemma3-270m (18 x 4)
SHAPES = {"wide": (4, 3), "narrow": (3, 2)}
IOI_CLASSES = ("name mover", "S-inhibition", "induction", "previous token")


def write_job(sweep, job: int, model: str, table: pd.DataFrame, study: str) -> None:
    """A sweep job's dir as a run writes it: its table, meta.json, the overrides and status.json."""
    run_dir = sweep / str(job)
    table = results.conform(table.assign(experiment="default", model=model, seed=0))
    results.write(table, run_dir, results.run_meta("0" * 12, {}, {"study": study}))
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text(f"- model={model}\n- study={study}\n")
    overrides = [f"model={model}", f"study={study}"]
    (run_dir / STATUS).write_text(json.dumps({"status": "done", "overrides": overrides}))


def atlas_table(layers: int, heads: int, seed: int, retrieval: bool) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    metrics = ["induction_score", "prev_token_score", "gu_first_token_attention", "attention_entropy"]
    rows = []
    for metric in metrics + (["needle_copy_score"] if retrieval else []):
        for layer in range(layers):
            for head in range(heads):
                value = float(rng.uniform(0, 0.8))
                rows.append(dict(layer=layer, head=head, metric=metric, value=value, ci_low=value - 0.05))
    rows = pd.DataFrame(rows).assign(ci_high=lambda d: d["value"] + 0.05)
    return labelled(rows, rules()).assign(intervention="none", method="score", task="repeat", n=10)


def ioi_table(layers: int, heads: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    grid = [(layer, head) for layer in range(layers) for head in range(heads)]
    scores = [dict(layer=l, head=h, metric="induction_score", value=0.1, method="score") for l, h in grid]
    chosen = rng.choice(len(grid), size=len(grid) // 2, replace=False)
    members = [
        dict(layer=grid[i][0], head=grid[i][1], group=IOI_CLASSES[j % len(IOI_CLASSES)], method="ioi_class")
        for j, i in enumerate(chosen)
    ]
    classes = [dict(row, metric=m, value=-0.1) for row in members for m in ("path_effect", "class_share")]
    return pd.DataFrame(scores + classes).assign(intervention="none", task="ioi", n=8)


def sweep_table(layers: int, heads: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    clean = dict(intervention="none", method="none", metric="logit_diff", value=2.0)
    swept = [
        dict(intervention="ablate_head", method="zero", layer=l, head=h, metric="logit_diff", value=rng.normal(2, 1))
        for l in range(layers)
        for h in range(heads)
    ]
    return pd.DataFrame([clean, *swept]).assign(task="ioi", n=8)


def sweep_of(tmp_path, make, study: str):
    sweep = tmp_path / "sweep"
    inputs = {}
    for job, (model, (layers, heads)) in enumerate(SHAPES.items()):
        inputs[model] = make(layers, heads, job)
        write_job(sweep, job, model, inputs[model], study)
    return sweep, inputs


def depth(names: list[str], layers: int) -> float:
    return float(np.mean([compare.head_of(n)[0] / (layers - 1) for n in names]))


def test_atlas_classes_per_model_equal_a_count_of_the_labels(tmp_path):
    sweep, inputs = sweep_of(tmp_path, lambda l, h, s: atlas_table(l, h, s, retrieval=s == 0), "atlas")
    result = run_headlab("compare", str(sweep), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = pd.read_parquet(sweep / "compare" / "compare.parquet")
    assert (sweep / "compare" / "compare.png").read_bytes().startswith(PNG)
    assert (sweep / "compare" / "compare.csv").is_file() and (sweep / "compare" / "meta.json").is_file()
    assert got["model"].unique().tolist() == list(SHAPES)
    for model, (layers, heads) in SHAPES.items():
        labels = inputs[model].assign(label=inputs[model]["label"].str.split(", ")).explode("label")
        labels = labels[labels["label"] != ""]
        labels = labels.assign(name="L" + labels["layer"].astype(str) + "H" + labels["head"].astype(str))
        counted = labels.drop_duplicates(["label", "name"])["label"].value_counts()
        mine = got[got["model"] == model].set_index("class")
        for cls in ("induction", "previous-token", "sink"):
            assert mine.loc[cls, "n_heads"] == counted.get(cls, 0)
            assert mine.loc[cls, "share"] == pytest.approx(counted.get(cls, 0) / (layers * heads))
            names = sorted(labels.loc[labels["label"] == cls, "name"].unique(), key=compare.head_of)
            assert mine.loc[cls, "heads"] == " ".join(names)
            if names:
                assert mine.loc[cls, "depth"] == pytest.approx(depth(names, layers))
        assert (mine["n_layers"] == layers).all() and (mine["n_model_heads"] == layers * heads).all()
    narrow = got[got["model"] == "narrow"].set_index("class")
    assert not narrow.loc["needle-copy", "measured"] and pd.isna(narrow.loc["needle-copy", "n_heads"])
    assert "IOI-supporting" not in set(got["class"])  # neither model scored it
    assert "induction" in result.stdout and "narrow" in result.stdout


def test_ioi_classes_per_model_equal_the_class_rows(tmp_path):
    sweep, inputs = sweep_of(tmp_path, ioi_table, "ioi_classes")
    out = tmp_path / "elsewhere"
    result = run_headlab("compare", str(sweep), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = pd.read_parquet(out / "compare.parquet")
    assert (out / "compare.png").read_bytes().startswith(PNG) and not (sweep / "compare").exists()
    for model, (layers, heads) in SHAPES.items():
        rows = inputs[model]
        counted = rows.loc[rows["metric"] == "path_effect", "group"].value_counts()
        mine = got[got["model"] == model].set_index("class")
        assert mine["n_heads"].sum() == counted.sum() == layers * heads // 2
        for cls in IOI_CLASSES:
            assert mine.loc[cls, "n_heads"] == counted.get(cls, 0)
            assert mine.loc[cls, "share"] == pytest.approx(counted.get(cls, 0) / (layers * heads))
        assert mine.loc["backup name mover", "n_heads"] == 0  # a class of the study that no head has
    assert not got["class"].str.startswith("unclassed").any()


def test_other_studies_compare_each_measures_top_heads(tmp_path):
    sweep, inputs = sweep_of(tmp_path, sweep_table, "sweep")
    target, got = compare.write(sweep)
    assert (target / "compare.png").read_bytes().startswith(PNG)
    assert got["class"].unique().tolist() == ["top 5% |ablate_head zero: logit_diff|"]
    for model in SHAPES:
        swept = inputs[model].dropna(subset=["layer"])
        effect = swept["value"] - 2.0
        top = swept.loc[effect.abs().idxmax()]
        row = got[got["model"] == model].iloc[0]
        assert row["heads"] == f"L{int(top['layer'])}H{int(top['head'])}"  # 5% of 6 or 12 heads: one
        assert row["value_median"] == pytest.approx(effect.median())


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    one = tmp_path / "one"
    write_job(one, 0, "wide", atlas_table(2, 2, 0, retrieval=False), "atlas")
    mixed = tmp_path / "mixed"
    write_job(mixed, 0, "wide", atlas_table(2, 2, 0, retrieval=False), "atlas")
    write_job(mixed, 1, "narrow", ioi_table(2, 2, 1), "ioi_classes")
    twice = tmp_path / "twice"
    for job, model in enumerate(("wide", "wide", "narrow")):
        write_job(twice, job, model, atlas_table(2, 2, job, retrieval=False), "atlas")
    edges = tmp_path / "edges"
    for job, model in enumerate(SHAPES):
        write_job(edges, job, model, pd.DataFrame([dict(metric="faithfulness", value=1.0, n=4)]), "circuit")
    unscored = tmp_path / "unscored"
    for job, model in enumerate(SHAPES):
        table = atlas_table(2, 2, job, retrieval=False)
        write_job(unscored, job, model, table[table["metric"] == "attention_entropy"], "atlas")
    for where, said in [
        (one, "is of model wide"),
        (unscored, "score no class"),
        (mixed, "different studies (atlas, ioi_classes)"),
        (twice, "2 runs of model wide"),
        (edges, "no per-head rows"),
    ]:
        result = run_headlab("compare", str(where), cwd=tmp_path)
        line = error_line(result)
        assert result.returncode != 0 and said in line and len(line) < 200, line
        assert not (where / "compare").exists()


def test_the_sweeps_models_are_read_from_its_jobs(tmp_path):
    sweep, _ = sweep_of(tmp_path, ioi_table, "ioi_classes")
    assert compare.swept_models(summarize(sweep)) == list(SHAPES)
    (sweep / "1" / STATUS).write_text(json.dumps({"status": "done", "overrides": ["model=wide", "seed=1"]}))
    assert compare.swept_models(summarize(sweep)) == ["wide"]
    for job, path in enumerate(("/a", "/b")):
        status = {"status": "skipped", "overrides": ["model=hf", f"model.path={path}"]}
        (sweep / str(job) / STATUS).write_text(json.dumps(status))
    assert compare.swept_models(summarize(sweep)) == ["hf /a", "hf /b"]
