"""Wang et al. 2022's IOI head classes by the paper's own procedure (arXiv 2211.00593, Sec. 3; the authors'
code: redwoodresearch/Easy-Transformer, experiments.py and easy_transformer/ioi_circuit_extraction.py):
working back from the logits, each class is the set of heads whose path into the class after it carries
the task, told apart from its neighbours by where the heads attend on the IOI prompts.

  round   path patching into (sender and receivers at)   class                rule (effect: the round's change in
                                                                               logit difference IO - S)
  logits  the logits (END)                               name mover           effect <= -TAU x clean; END attends
                                                                              IO at least ATTENTION, more than S2
                                                         negative name mover  effect >= +TAU x clean; the same
  backup  the logits (END), every name mover mean-       backup name mover    effect <= -TAU x clean and at least
          ablated at END                                                      TAU x clean below its logits-round
                                                                              effect; END attends IO as above
  q       the name movers' queries (END)                 S-inhibition         effect <= -TAU x clean; END attends
                                                                              S2 at least ATTENTION, more than IO
  v       the S-inhibition heads' values (S2)            induction            effect <= -TAU x clean; S2 attends
                                                                              S1+1 at least ATTENTION, more than S1
                                                         duplicate token      effect <= -TAU x clean; S2 attends
                                                                              S1 at least ATTENTION, no less than S1+1
  k       the induction heads' keys (S1+1)               previous token       effect <= -TAU x clean; S1+1 attends
                                                                              S1 at least ATTENTION

"clean" is the clean logit difference; the senders take their z from the ABC prompts (interventions/path.py);
attention is the pattern at (query role, key role) on the IOI prompts, averaged over them, as the paper reads
its classes off (S2 to S1 for duplicate-token heads, S2 to S1+1 for induction heads, S1+1 to S1 for
previous-token heads). A head keeps the first class it gets (rounds in the order above). A head that
reaches a round's size (logits: either sign; backup: both conditions; the others: the lowering) but gets
no class in any round is left unclassed, listed as "unclassed (<round>)" under the first such round.

Stability (class_shares): prompts are resampled with replacement, one draw for every round, every
attention read and the clean logit difference alike, and the rules are applied to the resample's means,
given the receivers (hence the senders) that all prompts gave: the model is not run again. A head's share
is the fraction of draws that put it in the class it has on all prompts.

Where it differs from the paper: the paper picks each class's heads by eye from its path-patching heatmaps
(the largest effects) and attention plots; TAU and ATTENTION state those choices as numbers. Its backup
round knocks out its three main name movers; here every name mover found is knocked out (the mean over
the ABC prompts of the same template, at END, as its code does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..tasks import TaskData

TAU = 0.02  # a head's share of the clean logit difference: 2% of 3.56 is 0.07 for GPT-2 small
# the attention a class's pattern needs (END to IO, S2 to S1+1, ...): a tenth of the query's, where the median
# head of smollm2-135m pays these keys 0.01-0.05 (most of the rest goes to the first token)
ATTENTION = 0.1
S1_NEXT = "S1+1"  # the role after S1, where the previous-token heads write for the induction heads' keys


@dataclass(frozen=True)
class Round:
    name: str
    receivers: str | None  # the class whose heads receive; None: the logits
    site: str | None  # how they are entered (q, k, v)
    token: str  # the position the sender and the receivers are patched at
    classes: tuple[str, ...]
    into: str  # what the senders' paths go into, in words


ROUNDS = (
    Round("logits", None, None, "END", ("name mover", "negative name mover"), "the logits"),
    Round("backup", None, None, "END", ("backup name mover",), "the logits, the name movers knocked out"),
    Round("q", "name mover", "q", "END", ("S-inhibition",), "the name movers' queries"),
    Round("v", "S-inhibition", "v", "S2", ("induction", "duplicate token"), "the S-inhibition heads' values"),
    Round("k", "induction", "k", S1_NEXT, ("previous token",), "the induction heads' keys"),
)
ROUND = {r.name: r for r in ROUNDS}
CLASSES = tuple(cls for r in ROUNDS for cls in r.classes)
UNCLASSED = {r.name: f"unclassed ({r.name})" for r in ROUNDS}
CLASS_METHOD = "ioi_class"  # the table's method for a class member's row (its group: the class)
KNOCKOUT = "name movers knocked out"  # the group of the backup round's rows
# attention read on the IOI prompts: name -> (query role, key role)
READS = {
    "attn_end_to_io": ("END", "IO"),
    "attn_end_to_s2": ("END", "S2"),
    "attn_s2_to_s1": ("S2", "S1"),
    "attn_s2_to_s1_next": ("S2", S1_NEXT),
    "attn_s1_next_to_s1": (S1_NEXT, "S1"),
}
RULE_TEXT = {
    "name mover": "effect <= -{tau} x clean; END attends IO >= {attention} and more than S2",
    "negative name mover": "effect >= +{tau} x clean; END attends IO >= {attention} and more than S2",
    "backup name mover": "effect <= -{tau} x clean and {tau} x clean below its logits-round effect; END attends "
    "IO >= {attention} and more than S2",
    "S-inhibition": "effect <= -{tau} x clean; END attends S2 >= {attention} and more than IO",
    "induction": "effect <= -{tau} x clean; S2 attends S1+1 >= {attention} and more than S1",
    "duplicate token": "effect <= -{tau} x clean; S2 attends S1 >= {attention} and no less than S1+1",
    "previous token": "effect <= -{tau} x clean; S1+1 attends S1 >= {attention}",
}


def with_s1_next(data: TaskData) -> TaskData:
    """The IOI prompts with the role S1+1 (the token after S1) beside IO, S1, S2 and END."""
    roles = dict(data.token_positions or {})
    return replace(data, token_positions={**roles, S1_NEXT: roles["S1"] + 1})


def role_attention(model: HookedModel, data: TaskData, batch_size: int = 16) -> dict[str, Tensor]:
    """name -> [layer, head, n]: each prompt's attention from the query role to the key role of READS."""
    roles = data.token_positions or {}
    chunks = []
    with torch.inference_mode():
        for b in range(0, data.n, batch_size):
            part = slice(b, b + batch_size)
            pairs = [(roles[q][part], roles[k][part]) for q, k in READS.values()]

            def read(pattern: Tensor, pairs: list[tuple[Tensor, Tensor]] = pairs) -> Tensor:
                rows = torch.arange(pattern.shape[0], device=pattern.device)
                return torch.stack([pattern[rows, :, q.to(rows.device), k.to(rows.device)] for q, k in pairs], -1)

            with model.kept("pattern", read) as seen:
                model.forward_blocks({k: v[part] for k, v in data.inputs.items()})
            chunks.append(torch.stack([seen[layer].float().cpu() for layer in range(model.n_layers)]))
    every = torch.cat(chunks, dim=1).transpose(1, 2)  # [layer, head, n, reads]
    return {name: every[..., j] for j, name in enumerate(READS)}


def head_names(mask: np.ndarray) -> list[str]:
    return [f"{layer}.{head}" for layer, head in zip(*np.nonzero(mask))]


def classify(
    effects: Mapping[str, np.ndarray],
    attention: Mapping[str, np.ndarray],
    clean: float,
    tau: float = TAU,
    min_attention: float = ATTENTION,
) -> dict[str, list[str]]:
    """class (and UNCLASSED[round]) -> heads "L.H" in layer, head order, from the rounds' effect grids
    ([layer, head], patched minus clean logit difference; NaN for a head that sent nothing) and the mean
    attention grids of READS. Classes of a round that was not run are left out."""
    size = tau * abs(clean)
    taken = np.zeros(next(iter(attention.values())).shape, bool)
    found: dict[str, list[str]] = {}

    def keep(cls: str, mask: np.ndarray) -> np.ndarray:
        nonlocal taken
        mask = mask & ~taken
        taken |= mask
        found[cls] = head_names(mask)
        return mask

    def effect(name: str) -> np.ndarray:
        return np.nan_to_num(effects[name], nan=0.0)

    a = {name: np.nan_to_num(grid) for name, grid in attention.items()}
    io, s2 = a["attn_end_to_io"], a["attn_end_to_s2"]
    to_io, to_s2 = (io >= min_attention) & (io > s2), (s2 >= min_attention) & (s2 > io)
    lowered = {name: effect(name) <= -size for name in effects}
    reached: dict[str, np.ndarray] = {}  # round -> the heads of the size its classes need
    if "logits" in effects:
        reached["logits"] = np.abs(effect("logits")) >= size
        keep("name mover", lowered["logits"] & to_io)
        keep("negative name mover", (effect("logits") >= size) & to_io)
    if "backup" in effects and "logits" in effects:
        reached["backup"] = lowered["backup"] & (effect("backup") - effect("logits") <= -size)
        keep("backup name mover", reached["backup"] & to_io)
    if "q" in effects:
        reached["q"] = lowered["q"]
        keep("S-inhibition", lowered["q"] & to_s2)
    if "v" in effects:
        reached["v"] = lowered["v"]
        dup, ind = a["attn_s2_to_s1"], a["attn_s2_to_s1_next"]
        keep("induction", lowered["v"] & (ind >= min_attention) & (ind > dup))
        keep("duplicate token", lowered["v"] & (dup >= min_attention) & (dup >= ind))
    if "k" in effects:
        reached["k"] = lowered["k"]
        keep("previous token", lowered["k"] & (a["attn_s1_next_to_s1"] >= min_attention))
    for name, mask in reached.items():  # no class in any round: listed under the first round it reached
        keep(UNCLASSED[name], mask)
    return found


def class_shares(
    effects: Mapping[str, np.ndarray],
    attention: Mapping[str, np.ndarray],
    clean: np.ndarray,
    found: Mapping[str, list[str]],
    tau: float = TAU,
    min_attention: float = ATTENTION,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """class -> head -> the share of n_boot resamples of the prompts that put the head in the class it has
    in `found`. effects and attention per prompt ([layer, head, n]), clean [n] (module docstring)."""
    n = clean.shape[0]
    draws = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    weights = np.stack([np.bincount(d, minlength=n) for d in draws]).T / n  # [n, n_boot]: each draw's mean
    means = {name: np.asarray(grid) @ weights for name, grid in effects.items()}
    reads = {name: np.asarray(grid) @ weights for name, grid in attention.items()}
    cleans = clean @ weights
    kept = {cls: dict.fromkeys(heads, 0) for cls, heads in found.items()}
    for b in range(n_boot):
        drawn = classify(
            {k: v[..., b] for k, v in means.items()},
            {k: v[..., b] for k, v in reads.items()},
            cleans[b],
            tau,
            min_attention,
        )
        for cls, heads in kept.items():
            for head in set(drawn.get(cls, ())) & heads.keys():
                heads[head] += 1
    return {cls: {head: count / n_boot for head, count in heads.items()} for cls, heads in kept.items()}


def receivers_of(round_: Round, found: Mapping[str, list[str]]) -> list[str]:
    """The heads a round patches into: its receiver class's (["logits"] for the logits)."""
    return ["logits"] if round_.receivers is None else list(found.get(round_.receivers, []))


def rules(tau: float = TAU, min_attention: float = ATTENTION) -> dict[str, str]:
    into = {cls: r for r in ROUNDS for cls in r.classes}
    return {
        cls: f"path patching into {into[cls].into} at {into[cls].token}: "
        + RULE_TEXT[cls].format(tau=f"{tau:g}", attention=f"{min_attention:g}")
        for cls in CLASSES
    }
