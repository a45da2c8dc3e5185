"""Wang et al. 2022's IOI head classes by the paper's own procedure (arXiv 2211.00593, Sec. 3): working back
from the logits, each class is the set of heads whose path into the class after it carries the task, told
apart from its neighbours by where the heads attend.

  round  receivers (entered by)       class                 rule (effect: the round's path-patching change
                                                            in logit difference IO - S, senders from ABC)
  1      the logits                   name mover            effect <= -TAU x clean, END attends IO more than S2
                                      negative name mover   effect >= +TAU x clean, END attends IO more than S2
  2      the name movers' queries     S-inhibition          effect <= -TAU x clean, END attends S2 more than IO
  3      the S-inhibition heads' values   induction         effect <= -TAU x clean, induction > duplicate score
                                      duplicate token       effect <= -TAU x clean, duplicate >= induction score
  4      the induction heads' keys    previous token        effect <= -TAU x clean, previous-token score above
                                                            its duplicate-token and induction scores

"clean" is the clean logit difference; attention is the mean pattern from END over the prompts; the three
scores are analysis/scores.py's, on repeated random tokens. A head keeps the first class it gets (rounds
run in the order above), since a head of a class is also a sender into the next round's receivers.

Where this differs from the paper: the paper picks each class's heads by eye from the path-patching
heatmaps (the largest effects); TAU states that choice as a number. The paper's backup name movers come
from knocking the name movers out and patching again; that round is not run here.
"""

from __future__ import annotations

import numpy as np

TAU = 0.02  # a head's share of the clean logit difference: 2% of 3.56 is 0.07 for GPT-2 small
# round -> (the class whose heads are its receivers, the site they are entered by); round 1's are the logits
ROUNDS: dict[str, tuple[str | None, str | None]] = {
    "logits": (None, None),
    "q": ("name mover", "q"),
    "v": ("S-inhibition", "v"),
    "k": ("induction", "k"),
}
CLASS_METHOD = "ioi_class"  # the table's method for a class member's row (its group: the class)
CLASSES_OF_ROUND = {
    "logits": ("name mover", "negative name mover"),
    "q": ("S-inhibition",),
    "v": ("induction", "duplicate token"),
    "k": ("previous token",),
}
CLASSES = (
    "name mover",
    "negative name mover",
    "S-inhibition",
    "induction",
    "duplicate token",
    "previous token",
)
RULE_TEXT = {
    "name mover": "path patching to the logits: effect <= -{tau} x clean; END attends IO more than S2",
    "negative name mover": "path patching to the logits: effect >= +{tau} x clean; END attends IO more than S2",
    "S-inhibition": "path patching to the name movers' queries: effect <= -{tau} x clean; END attends S2 more than IO",
    "induction": "path patching to the S-inhibition heads' values: effect <= -{tau} x clean; induction > duplicate",
    "duplicate token": "path patching to the S-inhibition heads' values: effect <= -{tau} x clean; "
    "duplicate >= induction",
    "previous token": "path patching to the induction heads' keys: effect <= -{tau} x clean; "
    "previous-token score highest",
}


def head_names(mask: np.ndarray) -> list[str]:
    return [f"{layer}.{head}" for layer, head in zip(*np.nonzero(mask))]


def classify(
    effects: dict[str, np.ndarray], scores: dict[str, np.ndarray], clean: float, tau: float = TAU
) -> dict[str, list[str]]:
    """class -> heads "L.H" in layer, head order, from the rounds' effect grids ([layer, head], patched minus
    clean logit difference; NaN for a head that sent nothing) and the score grids (attn_end_to_io,
    attn_end_to_s2, prev_token_score, duplicate_token_score, induction_score). Classes of a round that was
    not run are left out."""
    size = tau * abs(clean)
    taken = np.zeros(next(iter(scores.values())).shape, bool)
    found: dict[str, list[str]] = {}

    def keep(cls: str, mask: np.ndarray) -> None:
        nonlocal taken
        mask = mask & ~taken
        taken |= mask
        found[cls] = head_names(mask)

    def lowered(round_: str) -> np.ndarray:
        return np.nan_to_num(effects[round_], nan=0.0) <= -size

    io, s2 = np.nan_to_num(scores["attn_end_to_io"]), np.nan_to_num(scores["attn_end_to_s2"])
    to_io, to_s2 = io > s2, s2 > io
    if "logits" in effects:
        keep("name mover", lowered("logits") & to_io)
        keep("negative name mover", (np.nan_to_num(effects["logits"], nan=0.0) >= size) & to_io)
    if "q" in effects:
        keep("S-inhibition", lowered("q") & to_s2)
    if "v" in effects:
        inductive = np.nan_to_num(scores["induction_score"]) > np.nan_to_num(scores["duplicate_token_score"])
        keep("induction", lowered("v") & inductive)
        keep("duplicate token", lowered("v") & ~inductive)
    if "k" in effects:
        prev = np.nan_to_num(scores["prev_token_score"])
        others = np.maximum(np.nan_to_num(scores["duplicate_token_score"]), np.nan_to_num(scores["induction_score"]))
        keep("previous token", lowered("k") & (prev > others))
    return found


def receivers_of(round_: str, found: dict[str, list[str]]) -> list[str]:
    """The heads a round patches into: the class its row of ROUNDS names (empty: the round cannot run)."""
    cls = ROUNDS[round_][0]
    return ["logits"] if cls is None else found.get(cls, [])


def rules(tau: float = TAU) -> dict[str, str]:
    return {cls: RULE_TEXT[cls].format(tau=f"{tau:g}") for cls in CLASSES}
