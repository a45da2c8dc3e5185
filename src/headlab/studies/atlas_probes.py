"""The atlas's probes: each one a study headlab already has, run with the overrides below, and the atlas
rows read off its table.

A probe is exactly `headlab run <model> <overrides>`: its config is composed from those overrides, so the
atlas's number is the number that study writes (tests/test_atlas.py checks it), and its cache key is that
study's own config hash (Study.hash). Scores (the names `--scores` takes) map to probes; one probe may
serve several scores (the induction study gives the previous-token, duplicate-token and induction scores).

Atlas rows (one per head and score): layer, head, hook (the probe table's; none for composition, read off
the weights), metric (ATLAS_METRICS), value, n, ci_low, ci_high, `probe` (which study gave it), and for
composition `partner`, the head on the other side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..config import Config
from ..config_rules import COUNT, NATURAL, at_least, setting
from ..door import compose
from ..tables import head_name
from .composition import STUDY as COMPOSITION
from .induction import STUDY as INDUCTION
from .retrieval import STUDY as RETRIEVAL
from .sinks import STUDY as SINKS
from .study import Study, StudyOptions
from .sweep import STUDY as SWEEP

# headlab's shipped text, by the name configs give it (locations.text_path finds it wherever headlab is
# installed): an install's own path in the overrides would make each install's probe hashes its own
CORPUS = "data/alice.txt"
ROW_COLUMNS = ["layer", "head", "hook", "metric", "value", "n", "ci_low", "ci_high"]


@dataclass
class AtlasOptions(StudyOptions):
    """study=atlas's options (`headlab atlas --scores ...` sets `scores`): which scores, and the probe
    sizes. The defaults fit smollm2-135m's atlas in 10 minutes on 2 CPU cores (README)."""

    name: str = "atlas"
    scores: list[str] = field(default_factory=list)  # empty: every score (SCORES)
    repeat_sequences: int = setting(25, COUNT)  # induction: sequences of repeat_len random tokens, repeated once
    repeat_len: int = setting(50, at_least(2))
    ioi_prompts: int = setting(16, COUNT)  # IOI ablation of every head: the expensive probe
    copy_prompts: int = setting(64, COUNT)  # IOI prompts of the copy scores (one forward pass each)
    text_docs: int = setting(3, COUNT)  # next-token loss ablation of every head: documents of data/alice.txt
    text_len: int = setting(64, at_least(2))  # tokens per document (ablation, sinks and attention statistics)
    needle_prompts: int = setting(20, COUNT)  # retrieval: needle prompts over a data/alice.txt haystack
    # induction and retrieval: their best heads ablated (masked) together, against one random draw
    top_k: int = setting(5, COUNT)
    partners: int = setting(3, NATURAL)  # composition partners per head, mode and direction on its card


@dataclass(frozen=True)
class Probe:
    name: str  # the cache folder's prefix
    study: Study  # the study it runs (`headlab run study=...`)
    scores: tuple[str, ...]  # the atlas scores it yields (names `--scores` takes)
    overrides: Callable[[AtlasOptions], list[str]]  # beside the model's, seed and device
    needs_tokenizer: bool  # IOI, text and needle prompts need the model's tokenizer
    rows: Callable[[pd.DataFrame], pd.DataFrame]  # the study's table -> atlas rows


def score_rows(names: dict[str, str]) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """Per-head score rows (method "score"), metric renamed by `names` (the study's name -> the atlas's)."""

    def read(table: pd.DataFrame) -> pd.DataFrame:
        keep = (table["method"] == "score") & table["metric"].isin(list(names)) & table["layer"].notna()
        if "prompt_id" in table:
            keep &= table["prompt_id"].isna()
        rows = table.loc[keep, ROW_COLUMNS].copy()
        rows["metric"] = rows["metric"].map(names)
        return rows

    return read


def effect_rows(metric: str, name: str) -> Callable[[pd.DataFrame], pd.DataFrame]:
    """Each head's zero-ablation effect on `metric`: ablated minus clean, and the ablated value's 95%
    interval over prompts less the clean value (the report's heatmaps read the same way; the clean value
    is a constant here, not resampled with it)."""

    def read(table: pd.DataFrame) -> pd.DataFrame:
        aggregate = table["metric"] == metric
        if "prompt_id" in table:
            aggregate &= table["prompt_id"].isna()
        clean = float(table.loc[aggregate & (table["intervention"] == "none"), "value"].iloc[0])
        heads = table.loc[aggregate & (table["intervention"] == "ablate_head"), ROW_COLUMNS].copy()
        for col in ("value", "ci_low", "ci_high"):
            heads[col] = heads[col] - clean
        return heads.assign(metric=name, clean=clean)

    return read


def composition_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Per head and mode, its strongest partner as reader (`{mode}_composition_in`: the writer it reads
    most) and as writer (`{mode}_composition_out`: the reader that reads it most); `partner` names it."""
    frames = []
    for mode in ("q", "k", "v"):
        pairs = table[table["metric"] == f"{mode}_composition"]
        for side, me, other in (("in", "", "writer_"), ("out", "writer_", "")):
            best = pairs.sort_values("value", ascending=False, kind="stable").drop_duplicates(
                [f"{me}layer", f"{me}head"]
            )
            frames.append(
                pd.DataFrame(
                    {
                        "layer": best[f"{me}layer"].to_numpy(),
                        "head": best[f"{me}head"].to_numpy(),
                        "metric": f"{mode}_composition_{side}",
                        "value": best["value"].to_numpy(),
                        "n": 1,
                        "partner": [
                            head_name(int(a), int(b)) for a, b in zip(best[f"{other}layer"], best[f"{other}head"])
                        ],
                    }
                )
            )
    return pd.concat(frames, ignore_index=True).assign(ci_low=np.nan, ci_high=np.nan)


def partners(table: pd.DataFrame, k: int) -> dict[str, dict[str, list[list]]]:
    """head name -> {"q_in": [[partner, score], ...], "q_out": ..., ...}: each head's k strongest
    composition partners per mode and direction, for its card."""
    out: dict[str, dict[str, list[list]]] = {}
    for mode in ("q", "k", "v"):
        pairs = table[table["metric"] == f"{mode}_composition"].sort_values("value", ascending=False, kind="stable")
        for side, me, other in (("in", "", "writer_"), ("out", "writer_", "")):
            for (layer, head), group in pairs.groupby([f"{me}layer", f"{me}head"], sort=False):
                top = group.head(k)
                names = [head_name(int(a), int(b)) for a, b in zip(top[f"{other}layer"], top[f"{other}head"])]
                entry = out.setdefault(head_name(int(layer), int(head)), {})
                entry[f"{mode}_{side}"] = [[n, round(float(v), 4)] for n, v in zip(names, top["value"])]
    return out


def probe_config(cfg: Config, overrides: list[str]) -> Config:
    """The config `headlab run <overrides>` composes, on the atlas's model, training, seed and device (the
    probe's own task where it names one, else the atlas's: the one a model trained here was trained on)."""
    probe = compose(overrides)
    probe.model, probe.train = cfg.model, cfg.train
    if not any(o.startswith("task=") for o in overrides):
        probe.task = cfg.task
    probe.seed, probe.device, probe.threads, probe.name = cfg.seed, cfg.device, cfg.threads, cfg.name
    probe.output, probe.engine = cfg.output, cfg.engine
    return probe


def cache_dir(cfg: Config, name: str, key: str) -> Path:
    return Path(cfg.output.root) / "atlas" / cfg.model.name / f"{name}-{key}"


def text_overrides(o: AtlasOptions, n_docs: int) -> list[str]:
    return ["task=text", f"task.path={CORPUS}", f"task.seq_len={o.text_len}", f"task.n_prompts={n_docs}"]


PROBES = (
    Probe(
        "induction",
        INDUCTION,
        ("prev_token", "duplicate_token", "induction"),
        lambda o: [
            "study=induction",
            "study.icl_text=''",  # the ICL score's ablations on 512-token text: no atlas score reads them
            f"study.n_sequences={o.repeat_sequences}",
            f"study.repeat_len={o.repeat_len}",
            f"study.top_k={o.top_k}",
            "study.n_random=1",
        ],
        False,
        score_rows({n: n for n in ("prev_token_score", "duplicate_token_score", "induction_score")}),
    ),
    Probe(
        "copy",
        SWEEP,
        ("copy", "negative_copy"),
        lambda o: [
            "task=ioi",
            f"task.n_prompts={o.copy_prompts}",
            "ablate=none",
            "study.head_scores=true",
            "study.sequence_scores=false",  # the induction probe gives them
        ],
        True,
        score_rows({"copy_score": "copy_score", "negative_copy_score": "negative_copy_score"}),
    ),
    Probe(
        "sinks",
        SINKS,
        ("sink",),
        lambda o: [*text_overrides(o, 0), "study=sinks", f"study.seq_len={o.text_len}"],
        True,
        score_rows({"gu_first_token_attention": "gu_first_token_attention"}),
    ),
    # Wu et al.'s retrieval score on headlab's needle-copy screen, labelled as the screen it is (their protocol
    # on real text: `headlab run experiment=retrieval_heads_smollm2`, minutes per 1K-token prompt on a CPU)
    Probe(
        "needle_copy",
        RETRIEVAL,
        ("needle_copy",),
        lambda o: [
            "task=needle",
            f"task.haystack={CORPUS}",
            f"task.n_prompts={o.needle_prompts}",
            "study=retrieval",
            f"study.top_k={o.top_k}",
            "study.n_random=1",
            # 0.2's short cue prompt (an induction head can copy the needle on), needle-length greedy answers
            # scored on tokens, masking teacher-forced, no induction overlap
            "task.prompt=cue",
            "study.max_new_tokens=0",
            "study.recall=tokens",
            "study.masking=teacher_forced",
            "study.overlap_sequences=0",
        ],
        True,
        score_rows({"retrieval_score": "needle_copy_score"}),
    ),
    Probe(
        "composition",
        COMPOSITION,
        ("composition",),
        lambda o: ["study=composition", "study.channels=0"],  # the scores alone: no SVD of each pair
        False,
        composition_rows,
    ),
    Probe(
        "text_ablation",
        SWEEP,
        ("text_ablation",),
        lambda o: [*text_overrides(o, o.text_docs), "ablate=heads"],
        True,
        effect_rows("ce_loss", "text_loss_increase"),
    ),
    Probe(
        "ioi_ablation",
        SWEEP,
        ("ioi_ablation",),
        lambda o: ["task=ioi", f"task.n_prompts={o.ioi_prompts}", "ablate=heads"],
        True,
        effect_rows("logit_diff", "ioi_logit_diff_change"),
    ),
)
# the atlas's own probe (atlas_cards.py): attention entropy and distance on the text, and the cards
ATTENTION_SCORES = ("entropy", "distance")
SCORES = tuple(s for p in PROBES for s in p.scores) + ATTENTION_SCORES
# each score's rows (metric) in the atlas table
SCORE_METRICS = {
    "prev_token": ("prev_token_score",),
    "duplicate_token": ("duplicate_token_score",),
    "induction": ("induction_score",),
    "copy": ("copy_score",),
    "negative_copy": ("negative_copy_score",),
    "sink": ("gu_first_token_attention",),
    "needle_copy": ("needle_copy_score",),
    "text_ablation": ("text_loss_increase",),
    "ioi_ablation": ("ioi_logit_diff_change",),
    "composition": tuple(f"{m}_composition_{side}" for m in ("q", "k", "v") for side in ("in", "out")),
    "entropy": ("attention_entropy",),
    "distance": ("attention_distance",),
}
