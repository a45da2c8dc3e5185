"""The tidy result table: schema, bootstrap intervals, atomic writes, run metadata, collect.

One row per observation, core columns first and in this order, then `hook`; extra columns may follow. A
run dir is complete when meta.json exists: it is written last, after results.parquet and results.csv are
in place.

`hook` names the row's site as TransformerLens and SAELens do (vocabulary.hook_name), so that a table
joins with theirs on (hook, head):
  blocks.{l}.attn.hook_z        a head's z: ablate_head, keep_head, patch_head and a user's edit at site z,
                                path_patch (the sender's z; the receivers are in `receivers`, entered at
                                `site`), ablate_layer and scale_heads (head empty: every head's z), the
                                uniform sweep's mean_head_logits, SAE rows (an SAE on the layer's z)
  blocks.{l}.attn.hook_pattern  edits at site pattern, calibrate_sink, and every score read off a
                                pattern: sinks, previous-token, duplicate-token, induction, attn_end_to_*,
                                retrieval, attention per token, the atlas's entropy and distance
  blocks.{l}.attn.hook_q/_k/_v  edits at site q, k or v; copy_score and negative_copy_score (read off v)
  blocks.{l}.hook_mlp_out       ablate_mlp;  blocks.{l}.mlp.hook_post: ablate_neurons
  blocks.{l}.attn.hook_result   a head's output norm |z_h W_O^h| (output_norm); circuit nodes of a head
  edge rows                     the receiver's input (hook_q_input, hook_k_input, hook_v_input,
                                hook_mlp_in; logits: the last block's hook_resid_post), and `sender_hook`
                                the sender's output (attn.hook_result, hook_mlp_out; input:
                                blocks.0.hook_resid_pre)
ablate_layer is named by hook_z, not hook_attn_out: zeroing every head's z leaves the output projection's
bias, which zeroing hook_attn_out removes (mean and resample ablation agree at either). Empty (null) where
no single hook names the row: model-level rows (the clean run, sink_1, faithfulness, training curves,
knockouts), edits over several layers (ablated or masked groups of heads) or at two hooks (pattern_from
and values_from with the other heads ablated), scores from weights alone (composition), model=pathnet
(not a TransformerLens model), reuse rows, and tables written before the column existed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .errors import HeadlabError
from .io import atomic_write_bytes

CORE_COLUMNS = [
    "experiment",
    "model",
    "task",
    "seed",
    "intervention",
    "method",
    "layer",
    "head",
    "position",
    "metric",
    "value",
    "n",
    "ci_low",
    "ci_high",
]
HOOK = "hook"  # right after the core columns (see above); absent from tables written before it, null there
LEADING = [*CORE_COLUMNS, HOOK]
DTYPES = {
    "experiment": "string",
    "model": "string",
    "task": "string",
    "seed": "int64",
    "intervention": "string",
    "method": "string",
    "layer": "Int64",
    "head": "Int64",
    "position": "Int64",
    "metric": "string",
    "value": "float64",
    "n": "int64",
    "ci_low": "float64",
    "ci_high": "float64",
    "hook": "string",
    "sender_hook": "string",
    "prompt_id": "Int64",
    "other_head": "Int64",
    "site": "string",
    "token": "string",
    "receivers": "string",
    "feature": "Int64",
    "rank": "Int64",
    "sequence": "Int64",
    "query_position": "Int64",
    "context": "string",
    "edge": "string",
    "sender": "string",
    "receiver": "string",
    "sender_layer": "Int64",
    "sender_head": "Int64",
    "receiver_input": "string",
    "in_circuit": "boolean",
    "node": "string",
    "fraction": "float64",
    "n_edges": "Int64",
    "n_edges_ungrouped": "Int64",
    "ranking": "string",
}
TABLE, CSV, META = "results.parquet", "results.csv", "meta.json"
BOOT_VALUES = 2**23  # the most resampled quantities bootstrap holds at once (64 MB in float64)


def bootstrap(
    quantities: np.ndarray,
    answers: dict[str, np.ndarray],
    aggregates: dict,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Point estimate and percentile bootstrap interval over prompts, per row of quantities [k, n, Q]: the
    resamples of BOOT_VALUES values' worth of rows at once (an aggregate takes leading dimensions)."""
    k, n = quantities.shape[:2]
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    boot_answers = {name: value[idx] for name, value in answers.items()}
    at_once = max(1, BOOT_VALUES // max(1, n_boot * quantities[0].size))
    out = {
        metric: (np.asarray(fn(quantities, answers), dtype=float), np.full(k, np.nan), np.full(k, np.nan))
        for metric, fn in aggregates.items()
    }
    for first in range(0, k if n_boot else 0, at_once):
        resampled = quantities[first : first + at_once][:, idx]  # [rows, n_boot, n, Q], once for every metric
        for metric, fn in aggregates.items():
            samples = np.asarray(fn(resampled, boot_answers), dtype=float)  # [rows, n_boot]
            some = np.flatnonzero(np.isfinite(samples).any(1))
            if len(some):
                _, low, high = out[metric]
                bounds = np.nanpercentile(samples[some], [50 * (1 - level), 50 * (1 + level)], axis=1)
                low[first + some], high[first + some] = bounds
    return out


def tidy(
    run: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    quantities: np.ndarray,
    quantity_names: Sequence[str],
    answers: dict[str, np.ndarray],
    aggregates: dict,
    n_boot: int = 1000,
    per_prompt: bool = False,
) -> pd.DataFrame:
    """Long table from per-prompt quantities [k, n, Q]; rows[i] labels intervention i."""
    k, n, _ = quantities.shape
    stats = bootstrap(quantities, answers, aggregates, n_boot=n_boot, seed=int(run.get("seed", 0)))
    label = pd.DataFrame(list(rows))
    optional = [c for c in label.columns if c not in CORE_COLUMNS and label[c].isna().all()]
    label = label.drop(columns=optional)  # e.g. other_head, for sweeps that never swap heads
    frames = []
    for metric, (point, low, high) in stats.items():
        frames.append(label.assign(metric=metric, value=point, n=n, ci_low=low, ci_high=high))
    if per_prompt:
        for j, name in enumerate(quantity_names):
            frame = label.loc[label.index.repeat(n)].reset_index(drop=True)
            frames.append(
                frame.assign(
                    metric=name,
                    value=quantities[:, :, j].reshape(-1),
                    n=1,
                    ci_low=np.nan,
                    ci_high=np.nan,
                    prompt_id=np.tile(np.arange(n), k),
                )
            )
    df = pd.concat(frames, ignore_index=True)
    for key, value in run.items():
        df[key] = value
    return conform(df)


def conform(df: pd.DataFrame) -> pd.DataFrame:
    """Core columns and hook in order and with their dtypes, extra columns after."""
    for col in LEADING:
        if col not in df:
            df[col] = np.nan if DTYPES[col] == "float64" else pd.NA
    extra = [c for c in df.columns if c not in LEADING]
    df = df[LEADING + extra]
    return df.astype({c: t for c, t in DTYPES.items() if c in df.columns})


def write(df: pd.DataFrame, run_dir: Path, meta: dict[str, Any]) -> None:
    """results.parquet, results.csv, then meta.json; a failure part-way leaves only temp files removed."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / META).unlink(missing_ok=True)  # an old marker must not vouch for a new table
    tmp_table = run_dir / f".{TABLE}.tmp"
    tmp_csv = run_dir / f".{CSV}.tmp"
    try:
        df.to_parquet(tmp_table, index=False)
        df.to_csv(tmp_csv, index=False)
        os.replace(tmp_table, run_dir / TABLE)
        os.replace(tmp_csv, run_dir / CSV)
    finally:
        tmp_table.unlink(missing_ok=True)
        tmp_csv.unlink(missing_ok=True)
    atomic_write_bytes(run_dir / META, json.dumps(meta, indent=2, default=str).encode())


def read_meta(run_dir: Path) -> dict[str, Any]:
    """A run dir's meta.json ({} where it has none, it cannot be read or it does not parse)."""
    try:
        return json.loads((Path(run_dir) / META).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def add_meta(run_dir: Path, **fields: Any) -> None:
    """meta.json of a complete run dir with `fields` set, rewritten whole (atomic_write_bytes)."""
    if not (Path(run_dir) / META).is_file():
        return
    meta = {**read_meta(run_dir), **fields}
    atomic_write_bytes(Path(run_dir) / META, json.dumps(meta, indent=2, default=str).encode())


def is_complete(run_dir: Path) -> bool:
    return (Path(run_dir) / META).is_file() and (Path(run_dir) / TABLE).is_file()


def run_meta(config_hash: str, timings: dict[str, float], extra: dict | None = None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("headlab", "torch", "transformers", "hydra-core", "pandas", "pyarrow", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {
        "config_hash": config_hash,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "packages": versions,
        "seconds": {k: round(v, 4) for k, v in timings.items()},
        **(extra or {}),
    }


def git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def collect(directory: Path) -> pd.DataFrame:
    """Concatenate every complete run's table below `directory`, adding each job's overrides as columns."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadlabError(f"no such directory: {directory}")
    tables = sorted(p for p in directory.rglob(TABLE) if is_complete(p.parent))
    if not tables:
        raise HeadlabError(f"no complete results ({TABLE} with {META}) below {directory}")
    frames: list[pd.DataFrame] = []
    schema: dict[Hashable, str] = {}
    first: dict[Hashable, Path] = {}
    for path in tables:
        df = pd.read_parquet(path)
        for col, dtype in df.dtypes.items():
            known = schema.setdefault(col, str(dtype))
            first.setdefault(col, path)
            if known != str(dtype):
                raise HeadlabError(f"schema conflict in column '{col}': {known} in {first[col]} but {dtype} in {path}")
        for key, value in _job_overrides(path.parent).items():
            if key not in df.columns:
                df[key] = value
        df["run_dir"] = str(path.parent.relative_to(directory)) or "."
        frames.append(df)
    return conform(pd.concat(frames, ignore_index=True))


def _job_overrides(run_dir: Path) -> dict[str, str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    out = {}
    for item in OmegaConf.load(path):
        key, _, value = str(item).partition("=")
        key = key.lstrip("+~")
        if not key.startswith("hydra"):  # launcher and paths, not experiment parameters
            out[key] = value
    return out
