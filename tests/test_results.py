"""The tidy table: bootstrap intervals, schema and dtypes, atomic writes, collect."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from headlab import results
from headlab.errors import HeadlabError
from headlab.tasks import mean_of

RUN = {"experiment": "t", "model": "m", "task": "counting", "seed": 3}
ROWS = [
    {"intervention": "none", "method": "none", "layer": None, "head": None, "position": None},
    {"intervention": "ablate_head", "method": "zero", "layer": 0, "head": 2, "position": None},
]


def _table(per_prompt=False, n=200):
    rng = np.random.default_rng(0)
    q = np.stack([rng.normal(1.0, 2.0, (n, 1)), rng.normal(-0.5, 1.0, (n, 1))])
    df = results.tidy(RUN, ROWS, q, ("x",), {}, {"x_mean": mean_of(0)}, n_boot=2000, per_prompt=per_prompt)
    return df, q


def test_bootstrap_interval_contains_mean_and_has_the_normal_width():
    df, q = _table()
    for i, row in df.iterrows():
        values = q[i, :, 0]
        assert row["value"] == pytest.approx(values.mean())
        assert row["ci_low"] < values.mean() < row["ci_high"]
        half_width = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
        assert (row["ci_high"] - row["ci_low"]) / 2 == pytest.approx(half_width, rel=0.15)


def test_bootstrap_in_blocks_of_rows_is_each_rows_own_resampling(monkeypatch):
    # rows a few at a time (BOOT_VALUES), one with no defined value, and an aggregate reading the answers
    # over the resamples' leading dimensions: each row's interval is its own percentile bootstrap
    def kind_1(q: np.ndarray, answers: dict) -> np.ndarray:  # the mean of column 1 over kind-1 prompts
        mask = answers["kind"] == 1
        return np.where(mask, q[..., 1], 0).sum(-1) / mask.sum(-1)

    monkeypatch.setattr(results, "BOOT_VALUES", 3 * 300 * 40 * 2)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(7, 40, 2))
    q[4] = np.nan
    answers = {"kind": rng.integers(0, 2, 40)}
    aggregates = {"mean": mean_of(0), "kind_1": kind_1}
    got = results.bootstrap(q, answers, aggregates, n_boot=300, seed=5)
    idx = np.random.default_rng(5).integers(0, 40, size=(300, 40))
    for i in range(7):
        kinds = answers["kind"][idx] == 1
        by_hand = {
            "mean": q[i][idx][..., 0].mean(-1),
            "kind_1": np.array([q[i][idx[b]][kinds[b], 1].mean() for b in range(300)]),
        }
        for name, samples in by_hand.items():
            _, low, high = got[name]
            if i == 4:
                assert np.isnan(low[i]) and np.isnan(high[i])
                continue
            want = np.percentile(samples, [2.5, 97.5])
            assert low[i] == pytest.approx(want[0], abs=1e-12) and high[i] == pytest.approx(want[1], abs=1e-12)


def test_schema_order_dtypes_and_parquet_round_trip(tmp_path):
    df, _ = _table(per_prompt=True)
    assert list(df.columns[:15]) == results.LEADING and df.columns[15] == "prompt_id"
    assert str(df["layer"].dtype) == "Int64" and df["layer"].isna().sum() == 201  # clean rows
    assert len(df) == 2 + 2 * 200
    results.write(df, tmp_path, {"config_hash": "abc"})
    back = pd.read_parquet(tmp_path / "results.parquet")
    pd.testing.assert_frame_equal(back, df)
    assert results.is_complete(tmp_path)
    assert pd.read_csv(tmp_path / "results.csv").shape == df.shape


def test_failed_write_leaves_no_table_and_no_completion_marker(tmp_path, monkeypatch):
    df, _ = _table()
    results.write(df, tmp_path, {"config_hash": "old"})

    def explode(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_csv", explode)
    with pytest.raises(OSError):
        results.write(df, tmp_path, {"config_hash": "new"})
    assert not results.is_complete(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_collect_concatenates_and_refuses_conflicting_schemas(tmp_path):
    df, _ = _table()
    results.write(df, tmp_path / "0", {})
    results.write(df.assign(seed=4), tmp_path / "1", {})
    (tmp_path / "2").mkdir()
    df.to_parquet(tmp_path / "2" / "results.parquet")  # no meta.json: an unfinished run, skipped
    merged = results.collect(tmp_path)
    assert len(merged) == 2 * len(df) and sorted(merged["seed"].unique()) == [3, 4]
    results.write(df.assign(value=df["value"].astype(str)), tmp_path / "3", {})
    with pytest.raises(HeadlabError, match="schema conflict in column 'value'"):
        results.collect(tmp_path)


def test_collect_concatenates_tables_written_before_the_hook_column(tmp_path):
    df, _ = _table()
    new = df.assign(hook=pd.array([pd.NA, "blocks.0.attn.hook_z"], dtype="string"))
    results.write(new, tmp_path / "new", {})
    results.write(df.drop(columns="hook"), tmp_path / "old", {})  # as headlab wrote it before
    merged = results.collect(tmp_path)
    assert list(merged.columns[:15]) == results.LEADING and str(merged["hook"].dtype) == "string"
    assert merged["hook"].tolist() == [pd.NA, "blocks.0.attn.hook_z", pd.NA, pd.NA]
