"""IOI head classes (Wang et al. 2022, arXiv 2211.00593): the heads in each of the paper's classes, beside the
paper's GPT-2 small heads; drawn from the tidy table alone. A table of study=ioi_classes gives its classes
(the paper's procedure, analysis/ioi_classes.py), with each head's class share and the heads left
unclassed; any other table's heads are put in classes by their scores, as follows.

  ioi_head_classes.png   left: layer x head grid labelled with the classes found; right: per class the
                         paper's GPT-2 small heads, the heads found, and (on GPT-2 small) precision / recall

A head is put in a class by its scores (analysis/scores.py), with the thresholds in RULES:
  previous token / duplicate token / induction   that score on repeated random tokens >= ATTN
  S-inhibition                                   END attends to S2 >= ATTN
  name mover                                     END attends to IO >= ATTN and copy score >= COPY
  negative name mover                            END attends to IO >= ATTN and negative copy score >= COPY
  backup name mover                              a name mover by its scores whose direct effect (path patching
                                                 to the logits) is under BACKUP x the strongest name mover's
The paper finds backup name movers by knocking out the name movers (study=ioi_classes does); the direct-
effect split is a stand-in that needs path-patching rows (without them every head with name-mover scores is
a name mover).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..analysis.ioi_classes import CLASS_METHOD, CLASSES, UNCLASSED, rules  # noqa: E402
from ..tables import score_grids  # noqa: E402
from . import ioi_diagram  # noqa: E402
from .canvas import save

ATTN = 0.3  # attention share: 10x the uniform share over the ~30 tokens of an IOI prompt
COPY = 0.5  # copy scores: the name is in the top 5 logits on most prompts
BACKUP = 0.2
# The paper's classes in circuit order (earliest first), with its GPT-2 small heads as its code lists them
# (ioi_circuit_extraction.py's CIRCUIT; Fig. 2 of the paper names the same heads).
PAPER = {
    "previous token": ["2.2", "4.11"],
    "duplicate token": ["0.1", "0.10", "3.0"],
    "induction": ["5.5", "5.8", "5.9", "6.9"],
    "S-inhibition": ["7.3", "7.9", "8.6", "8.10"],
    "name mover": ["9.9", "9.6", "10.0"],
    "backup name mover": ["10.10", "10.6", "10.2", "10.1", "11.2", "9.7", "9.0", "11.9"],
    "negative name mover": ["10.7", "11.10"],
}
RULES = {  # class -> [(score, threshold)], all must hold
    "previous token": [("prev_token_score", ATTN)],
    "duplicate token": [("duplicate_token_score", ATTN)],
    "induction": [("induction_score", ATTN)],
    "S-inhibition": [("attn_end_to_s2", ATTN)],
    "name mover": [("attn_end_to_io", ATTN), ("copy_score", COPY)],
    "negative name mover": [("attn_end_to_io", ATTN), ("negative_copy_score", COPY)],
}
SHORT = {
    "previous token": "PT",
    "duplicate token": "DT",
    "induction": "IND",
    "S-inhibition": "SI",
    "name mover": "NM",
    "backup name mover": "BNM",
    "negative name mover": "NNM",
}
GPT2_SMALL = "gpt2"  # the model name whose heads are compared with the paper's index for index


def direct_effect(df: pd.DataFrame, shape: tuple[int, int]) -> np.ndarray | None:
    """[layer, head] drop in logit diff when the head's path to the logits is patched (None without rows)."""
    if "receivers" not in df:
        return None
    clean = df[(df["intervention"] == "none") & (df["method"] == "none") & (df["metric"] == "logit_diff")]
    rows = df[(df["intervention"] == "path_patch") & (df["metric"] == "logit_diff")]
    rows = rows[(rows["receivers"] == "logits").fillna(False)].dropna(subset=["layer", "head"])
    if "group" in rows:  # a round with heads knocked out is no direct effect of the model's own
        rows = rows[rows["group"].isna()]
    if rows.empty or clean.empty:
        return None
    drop = rows["seed"].map(clean.groupby("seed")["value"].mean()) - rows["value"]
    m = np.full(shape, np.nan)
    for (layer, head), v in drop.groupby([rows["layer"], rows["head"]]).mean().items():
        m[int(layer), int(head)] = v
    return m


def classify(scores: dict[str, np.ndarray], direct: np.ndarray | None) -> dict[str, list[str]]:
    """class -> heads "L.H" (in layer, head order) by RULES; classes whose scores are missing are left out."""
    found: dict[str, list[str]] = {}
    for cls, rule in RULES.items():
        if not all(score in scores for score, _ in rule):
            continue
        ok = np.logical_and.reduce([np.nan_to_num(scores[s], nan=-np.inf) >= t for s, t in rule])
        found[cls] = [f"{layer}.{head}" for layer, head in zip(*np.nonzero(ok))]
    movers = found.get("name mover", [])
    if direct is not None and movers:
        effect = {h: float(np.nan_to_num(direct[tuple(map(int, h.split(".")))])) for h in movers}
        strongest = max(effect.values())
        weak = [h for h in movers if strongest > 0 and effect[h] < BACKUP * strongest]
        found["name mover"] = [h for h in movers if h not in weak]
        found["backup name mover"] = weak
    return {cls: found[cls] for cls in PAPER if cls in found}


def procedure_classes(df: pd.DataFrame) -> dict[str, list[str]]:
    """class -> heads "L.H" from the class rows of study=ioi_classes (Wang et al.'s procedure), in its
    class order; empty where the table has none. A class the procedure left empty is absent."""
    if not {"method", "group"} <= set(df.columns):
        return {}
    rows = df[df["method"] == CLASS_METHOD].dropna(subset=["layer", "head"])
    found: dict[str, list[str]] = {}
    for cls in CLASSES:
        part = rows[rows["group"] == cls].drop_duplicates(["layer", "head"]).sort_values(["layer", "head"])
        if len(part):
            found[cls] = [f"{int(r.layer)}.{int(r.head)}" for r in part.itertuples()]
    return found


def procedure_shares(df: pd.DataFrame, metric: str = "class_share") -> dict[str, dict[str, float]]:
    """class (or unclassed group) -> head -> its class share (or, metric="path_effect", the path-patching
    effect of the round that put it there), from study=ioi_classes' class rows."""
    if not {"method", "group"} <= set(df.columns):
        return {}
    rows = df[(df["method"] == CLASS_METHOD) & (df["metric"] == metric)].dropna(subset=["layer", "head"])
    return {
        str(cls): {f"{int(r.layer)}.{int(r.head)}": float(r.value) for r in part.itertuples()}
        for cls, part in rows.groupby("group")
    }


def _layer(head: str) -> int:
    return int(head.split(".")[0])


def structure(found: dict[str, list[str]]) -> dict:
    """Mean layer of each class found, and whether the circuit has the paper's order (None: a class is empty)."""
    mean = {cls: float(np.mean([_layer(h) for h in heads])) for cls, heads in found.items() if heads}
    early = [_layer(h) for cls in ("induction", "duplicate token") for h in found.get(cls, [])]

    def before(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a < b

    si, nm = mean.get("S-inhibition"), mean.get("name mover")
    return {
        "mean_layer": mean,
        "s_inhibition_before_name_movers": before(si, nm),
        "induction_duplicate_before_s_inhibition": before(float(np.mean(early)) if early else None, si),
    }


def versus_paper(found: dict[str, list[str]]) -> dict:
    """Per class: precision / recall of the heads found against the paper's (None where undefined)."""
    out = {}
    for cls, heads in found.items():
        hits = len(set(heads) & set(PAPER[cls]))
        out[cls] = {
            "precision": hits / len(heads) if heads else None,
            "recall": hits / len(PAPER[cls]),
            "hits": hits,
        }
    return out


def draw(df: pd.DataFrame, out: Path, shape: tuple[int, int], model: str | None) -> dict:
    """ioi_head_classes.png into `out` from one model's rows; returns the classes and comparisons."""
    found = procedure_classes(df)
    if found:
        numbers: dict = {"procedure": "path patching, Wang et al. Sec. 3 (study=ioi_classes)", "rules": rules()}
        shares = procedure_shares(df)
        numbers["class_shares"] = {cls: heads for cls, heads in shares.items() if cls in CLASSES}
        numbers["unclassed"] = {cls: heads for cls, heads in shares.items() if cls in UNCLASSED.values()}
        numbers["path_effects"] = procedure_shares(df, "path_effect")
    else:
        found = classify(score_grids(df, shape), direct_effect(df, shape))
        numbers = {
            "procedure": "head scores (figures/ioi_classes.py RULES)",
            "thresholds": {"attention": ATTN, "copy": COPY, "backup_direct_effect_share": BACKUP},
        }
    if not found:
        return {}
    numbers.update({"found": found, "paper_gpt2_small": PAPER, "structure": structure(found)})
    # the diagram's arrows are the path-patching rounds: drawn only for the classes they found
    diagram = ioi_diagram.draw(found, shape[0], str(model), out) if numbers["procedure"].startswith("path") else None
    if diagram:
        numbers["diagram"] = diagram
    gpt2 = model == GPT2_SMALL
    if gpt2:
        numbers["vs_paper"] = versus_paper(found)

    fig, (grid_ax, table_ax) = plt.subplots(
        1, 2, figsize=(max(4.0, 1.5 + 0.5 * shape[1]) + 7.5, max(3.0, 1.2 + 0.4 * shape[0])), squeeze=True
    )
    labels = np.full(shape, "", dtype=object)
    colour = np.full(shape, np.nan)
    for cls, heads in found.items():
        for h in heads:
            layer, head = map(int, h.split("."))
            labels[layer, head] = "/".join(filter(None, [labels[layer, head], SHORT[cls]]))
            colour[layer, head] = list(PAPER).index(cls)
    grid_ax.imshow(colour, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for (layer, head), text in np.ndenumerate(labels):
        grid_ax.text(head, layer, text, ha="center", va="center", fontsize=6)
    grid_ax.set_xticks(range(shape[1]))
    grid_ax.set_yticks(range(shape[0]))
    grid_ax.tick_params(labelsize=7)
    grid_ax.set_xlabel("head")
    grid_ax.set_ylabel("layer")
    how = "path patching" if numbers["procedure"].startswith("path") else "head scores"
    grid_ax.set_title(f"{model}: head classes from {how}", fontsize=8)
    rows = []
    for cls in PAPER:
        cells = [SHORT[cls] + " " + cls, ", ".join(PAPER[cls]), ", ".join(found.get(cls, [])) or "-"]
        if gpt2:
            v = numbers["vs_paper"].get(cls, {})
            p, r = v.get("precision"), v.get("recall")
            cells.append("-" if r is None else f"{'n/a' if p is None else f'{p:.2f}'} / {r:.2f}")
        rows.append(cells)
    cols = ["class", "paper (GPT-2 small)", f"found ({model})"] + (["precision / recall"] if gpt2 else [])
    table_ax.axis("off")
    tab = table_ax.table(cellText=rows, colLabels=cols, loc="center", cellLoc="left")
    tab.auto_set_font_size(False)
    tab.set_fontsize(6)
    tab.auto_set_column_width(list(range(len(cols))))
    table_ax.set_title("Wang et al. 2022's classes beside the heads found here", fontsize=8)
    save(fig, out / "ioi_head_classes.png", dpi=110)
    return numbers
