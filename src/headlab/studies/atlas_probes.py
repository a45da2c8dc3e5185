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
from ..errors import UsageError
from ..tables import head_name
from .atlas_rules import Rule
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
    scores: list[str] = field(default_factory=list)  # empty: every score (scores())
    repeat_sequences: int = setting(25, COUNT)  # induction: sequences of repeat_len random tokens, repeated once
    repeat_len: int = setting(50, at_least(2))
    ioi_prompts: int = setting(16, COUNT)  # IOI ablation of every head: the expensive probe
    copy_prompts: int = setting(64, COUNT)  # IOI prompts of the copy scores (one forward pass each)
    text_docs: int = setting(3, COUNT)  # next-token loss ablation of every head: documents of data/alice.txt
    text_len: int = setting(64, at_least(2))  # tokens per document (ablation, sinks and attention statistics)
    needle_prompts: int = setting(20, COUNT)  # retrieval: needle prompts over a data/alice.txt haystack
    partners: int = setting(3, NATURAL)  # composition partners per head, mode and direction on its card


@dataclass(frozen=True)
class Score:
    """One atlas score: its name (`--scores` takes it), the metrics of its rows, the rules that label heads by
    them (each with its code on the grid)."""

    name: str
    metrics: tuple[str, ...]
    rules: tuple[Rule, ...] = ()


@dataclass(frozen=True)
class Probe:
    name: str  # the cache folder's prefix
    study: Study  # the study it runs (`headlab run study=...`)
    scores: tuple[Score, ...]  # the atlas scores it yields
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


# the rules that label heads by a score: where the literature states a threshold the rule uses it and names
# the paper; where it ranks heads without a cut the threshold is headlab's and the source says so
OURS = "headlab's threshold: the paper ranks heads by this score and states no cut"


def _interval_above(label: str, code: str, metric: str, cut: float, source: str) -> Rule:
    return Rule(label, code, metric, ">", cut, "interval", False, source)


def _value_above(label: str, code: str, metric: str, cut: float, source: str) -> Rule:
    return Rule(label, code, metric, ">", cut, "value", False, source)


PROBES: list[Probe] = [
    Probe(
        "induction",
        INDUCTION,
        (
            Score(
                "prev_token",
                ("prev_token_score",),
                (_interval_above("previous-token", "PT", "prev_token_score", 0.4, f"{OURS} (Olsson et al. 2022)"),),
            ),
            Score(
                "duplicate_token",
                ("duplicate_token_score",),
                (_interval_above("duplicate-token", "DT", "duplicate_token_score", 0.4, f"{OURS} (Wang et al. 2022)"),),
            ),
            Score(
                "induction",
                ("induction_score",),
                (_interval_above("induction", "IND", "induction_score", 0.4, f"{OURS} (Olsson et al. 2022)"),),
            ),
        ),
        lambda o: [
            "study=induction",
            "study.icl_text=''",  # the ICL score's ablations on 512-token text: no atlas score reads them
            f"study.n_sequences={o.repeat_sequences}",
            f"study.repeat_len={o.repeat_len}",
            "study.top_k=0",  # the scores alone: the best heads' joint ablation is no atlas score
        ],
        False,
        score_rows({n: n for n in ("prev_token_score", "duplicate_token_score", "induction_score")}),
    ),
    Probe(
        "copy",
        SWEEP,
        (
            Score(
                "copy",
                ("copy_score",),
                (
                    _value_above(
                        "copy",
                        "CP",
                        "copy_score",
                        0.9,
                        "Wang et al. 2022: GPT-2 small's name movers copy in "
                        "over 95% of prompts, an average head in under 20%",
                    ),
                ),
            ),
            Score(
                "negative_copy",
                ("negative_copy_score",),
                (
                    _value_above(
                        "negative-copy",
                        "NCP",
                        "negative_copy_score",
                        0.9,
                        "Wang et al. 2022's copy score with the sign flipped, the same cut as copy",
                    ),
                ),
            ),
        ),
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
        (
            Score(
                "sink",
                ("gu_first_token_attention",),
                (
                    _value_above(
                        "sink",
                        "SNK",
                        "gu_first_token_attention",
                        0.3,
                        "Gu et al. 2024: a head is a sink head when its first-token attention exceeds epsilon = 0.3",
                    ),
                ),
            ),
        ),
        lambda o: [*text_overrides(o, 0), "study=sinks", f"study.seq_len={o.text_len}"],
        True,
        score_rows({"gu_first_token_attention": "gu_first_token_attention"}),
    ),
    # Wu et al.'s retrieval score on headlab's needle-copy screen, labelled as the screen it is (their protocol
    # on real text: `headlab reproduce retrieval_wu`, minutes per prompt on a CPU)
    Probe(
        "needle_copy",
        RETRIEVAL,
        (
            Score(
                "needle_copy",
                ("needle_copy_score",),
                (
                    _value_above(
                        "needle-copy",
                        "NDC",
                        "needle_copy_score",
                        0.1,
                        "headlab's screen: Wu et al.'s retrieval score (needle tokens copied from where "
                        "attention peaks) above their 0.1, on a cue prompt an induction head solves, "
                        "teacher-forced; not their retrieval heads",
                    ),
                ),
            ),
        ),
        lambda o: [
            "task=needle",
            f"task.haystack={CORPUS}",
            f"task.n_prompts={o.needle_prompts}",
            "study=retrieval",
            "study.top_k=0",  # the scores alone: no masking, no overlap with the induction heads
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
        (Score("composition", tuple(f"{m}_composition_{side}" for m in ("q", "k", "v") for side in ("in", "out"))),),
        lambda o: ["study=composition", "study.channels=0"],  # the scores alone: no SVD of each pair
        False,
        composition_rows,
    ),
    Probe(
        "ioi_ablation",
        SWEEP,
        (
            Score(
                "ioi_ablation",
                ("ioi_logit_diff_change",),
                (
                    Rule(
                        "IOI-supporting",
                        "IO+",
                        "ioi_logit_diff_change",
                        "<",
                        -0.2,
                        "value",
                        True,
                        "headlab's threshold: zero-ablating the head removes a fifth of the clean IOI logit difference",
                    ),
                    Rule(
                        "IOI-opposing",
                        "IO-",
                        "ioi_logit_diff_change",
                        ">",
                        0.2,
                        "value",
                        True,
                        "headlab's threshold: zero-ablating the head raises the clean IOI logit difference by a fifth",
                    ),
                ),
            ),
        ),
        lambda o: ["task=ioi", f"task.n_prompts={o.ioi_prompts}", "ablate=heads"],
        True,
        effect_rows("logit_diff", "ioi_logit_diff_change"),
    ),
    Probe(
        "text_ablation",
        SWEEP,
        (
            Score(
                "text_ablation",
                ("text_loss_increase",),
                (
                    _interval_above(
                        "loss-critical",
                        "LC",
                        "text_loss_increase",
                        0.05,
                        "headlab's threshold: zero-ablating the head raises the next-token loss on the text "
                        "by 0.05 nats",
                    ),
                ),
            ),
        ),
        lambda o: [*text_overrides(o, o.text_docs), "ablate=heads"],
        True,
        effect_rows("ce_loss", "text_loss_increase"),
    ),
]
# the atlas's own probe (atlas_cards.py): attention entropy and distance on the text, and the cards
ATTENTION = (Score("entropy", ("attention_entropy",)), Score("distance", ("attention_distance",)))


def left_out(probe: Probe, model_name: str, has_tokenizer: bool, n_layers: int) -> str | None:
    """Why the atlas leaves `probe` out on this model (its note), or None where it runs."""
    if probe.needs_tokenizer and not has_tokenizer:
        named = ", ".join(s.name for s in probe.scores)
        return f"atlas: {model_name} has no tokenizer: {named} left out (its prompts are text)"
    if probe.name == "composition" and n_layers < 2:
        return f"atlas: {model_name} has one layer: composition left out"
    return None


def register(probe: Probe) -> Probe:
    """Add a probe (a study run with its overrides, the scores it yields, each with its rules and codes):
    `headlab atlas` then runs it, and `study.scores=[<its score>]` picks it."""
    taken = set(scores())
    clash = [s.name for s in probe.scores if s.name in taken]
    if clash or probe.name in {p.name for p in PROBES}:
        raise UsageError(f"atlas probe {probe.name}: {', '.join(clash) or probe.name} is taken; choose another name")
    PROBES.append(probe)
    return probe


def probes() -> tuple[Probe, ...]:
    """Every probe, headlab's and those registered since, in the order the atlas runs them."""
    return tuple(PROBES)


def scores() -> dict[str, Score]:
    """Every atlas score by name (`study.scores` takes these), the probes' first, then the atlas's own."""
    return {s.name: s for s in (*(s for p in PROBES for s in p.scores), *ATTENTION)}


def rules() -> tuple[Rule, ...]:
    """Every score's rules, in the scores' order."""
    return tuple(r for s in scores().values() for r in s.rules)
