"""Sentences of the docs pages whose numbers are read from numbers files (report/numbers.py puts them in
place, as it puts the tables of readme_tables.py).

PROSE maps (reproduction, piece) to a function of the parsed numbers.json returning the paragraph;
PROSE_OF_FILES does the same for a block naming several files joined by "+". Where a paragraph's words
compare its numbers (deeper, larger, in order), the function picks the words from the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..compare import class_row
from .readme_tables import Numbers, fmt, get, ioi_model

# the layers of Wang et al.'s GPT-2 small, whose heads the numbers files list by the paper's names
GPT2_SMALL_LAYERS = 12


def paragraph(text: str, width: int = 110) -> str:
    """The text in lines of at most width characters, as the pages wrap theirs; a line breaks only before a
    word that starts with a letter, so that no line opens a list, a heading or a table."""
    lines = [""]
    for word in text.split(" "):
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width and word[:1].isalpha():
            lines.append(word)
        else:
            lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return "\n".join(lines)


def _heads(heads: Any) -> list[tuple[int, int]]:
    """(layer, head) of heads named "layer.head"."""
    named = [h.split(".") for h in heads or [] if isinstance(h, str)]
    return [(int(p[0]), int(p[1])) for p in named if len(p) == 2 and p[0].isdigit() and p[1].isdigit()]


def _layers(heads: Any) -> list[int]:
    """The layers of heads named "layer.head"."""
    return [layer for layer, _ in _heads(heads)]


def _span(layers: list[int]) -> str:
    low, high = min(layers), max(layers)
    return f"{low}" if low == high else f"{low}-{high}"


def _top(n: Numbers, score: str) -> dict[Any, Any]:
    """The heads a numbers file lists as the top of a head score, with their values."""
    return {e.get("head"): e.get("value") for e in get(n, f"head_scores.{score}") or [] if isinstance(e, dict)}


def ioi_shape(numbers: Numbers) -> str:
    """How the classes of `reproduce ioi` sit in the depth beside the paper's, and how stable they are."""
    n = ioi_model(numbers)
    found = get(n, "head_classes.found") or {}
    movers, n_layers = _layers(found.get("name mover")), n.get("n_layers")
    paper = _layers(get(n, "head_classes.paper_gpt2_small.name mover"))
    shares = [s for cls in found for s in (get(n, f"head_classes.class_shares.{cls}") or {}).values()]
    kept = sum(1 for s in shares if s == 1.0)
    top = (get(n, "path_patching.logits") or [{}])[0].get("head")
    unclassed = any(top in heads for heads in (get(n, "head_classes.unclassed") or {}).values())
    if not (movers and paper and isinstance(n_layers, int) and shares and top and unclassed):
        return "The numbers file lacks the classes' layers, shares or the logits round's largest effect."
    share = sum(movers) / len(movers) / n_layers
    same = min(paper) / GPT2_SMALL_LAYERS <= share <= max(paper) / GPT2_SMALL_LAYERS
    ordered = get(n, "head_classes.structure.s_inhibition_before_name_movers") is True and (
        get(n, "head_classes.structure.induction_duplicate_before_s_inhibition") is True
    )
    layer = "layer" if len(set(movers)) == 1 else "layers"
    opening = "The classes have the paper's shape, in" if ordered else "The classes sit in"
    shape = (
        f"{opening} {'the same' if same else 'another'} share of the depth: name "
        f"movers at {fmt(100 * share, 0)}% of it ({layer} {_span(movers)} of {n_layers}; {_span(paper)} of "
        f"{GPT2_SMALL_LAYERS} in GPT-2 small), "
        + (
            "S-inhibition heads just before them, induction heads before those, fed by a previous-token head's "
            "keys, a negative name mover right after the name movers."
            if ordered
            else "but not in the paper's order."
        )
    )
    most = "Most heads" if kept > len(shares) / 2 else "Fewer than half of the heads"
    stable = (
        f" {most} keep their class in every resample ({kept} of the {len(shares)} at share {fmt(1.0)} above); "
        "those with lower shares sit near tau, and more prompts do not settle them."
    )
    s2, negative = _top(n, "attn_end_to_s2"), _top(n, "negative_copy_score")
    why = (
        ": END attends S2 more than IO there and its negative copy score is high, so it writes against S rather "
        "than moving IO, a role the paper's classes do not name."
        if top in s2 and (negative.get(top) or 0) >= 0.5
        else "."
    )
    return paragraph(shape + stable + f" The largest direct effect, {top}, is unclassed" + why)


DEPTH_ORDER = ("previous token", "induction", "S-inhibition", "name mover")


def _depths(n: Numbers) -> dict[str, float]:
    """Each class's mean relative depth, layer / (n_layers - 1), as `headlab compare` computes it."""
    found, n_layers = get(n, "head_classes.found") or {}, n.get("n_layers")
    if not isinstance(n_layers, int) or n_layers < 2:
        return {}
    return {cls: class_row(heads, n_layers)["depth"] for cls in DEPTH_ORDER if (heads := _heads(found.get(cls)))}


def _class_share(n: Numbers) -> float:
    """The share of the model's heads that the classes hold."""
    found, n_layers, n_heads = get(n, "head_classes.found") or {}, n.get("n_layers"), n.get("n_heads")
    held = {h for heads in found.values() for h in heads or []}
    return len(held) / (n_layers * n_heads) if isinstance(n_layers, int) and isinstance(n_heads, int) else 0.0


def ioi_depths(files: dict[str, Numbers]) -> str:
    """smollm2-135m's and gemma3-270m's IOI classes side by side, as `headlab compare` draws them."""
    models = {get(ioi_model(n), "model") or name: ioi_model(n) for name, n in files.items()}
    smollm2 = next((n for m, n in models.items() if "smollm2" in m), {})
    gemma = next((n for m, n in models.items() if "gemma" in m), {})
    ours, theirs = _depths(smollm2), _depths(gemma)
    if any(cls not in d for d in (ours, theirs) for cls in DEPTH_ORDER):
        return "The numbers files lack a class's heads or the models' depth."
    early = ("previous token", "induction")
    ordered = all(max(d[c] for c in early) < d["S-inhibition"] < d["name mover"] for d in (ours, theirs))
    lower = all(theirs[c] < ours[c] for c in early)
    higher = all(theirs[c] > ours[c] for c in early)
    where = "lower in" if lower else "higher in" if higher else "elsewhere in"
    share = "a larger" if _class_share(gemma) > _class_share(smollm2) else "a smaller"
    order = (
        "in both, previous-token and induction heads come before the S-inhibition heads, and those before the "
        "name movers"
        if ordered
        else "the classes do not come in the same order in both"
    )
    return paragraph(
        "The two IOI reproductions' class runs, side by side (`headlab compare` on the `study=ioi_classes` run "
        "directories of `outputs/reproduce/ioi/` and `outputs/reproduce/ioi-gemma3-270m/`; docs/numbers/ioi.json "
        f"and docs/numbers/ioi-gemma3-270m.json hold their classes): {order}; Gemma's previous-token and "
        f"induction heads sit {where} the depth ({fmt(theirs['previous token'])} and {fmt(theirs['induction'])} "
        f"against {fmt(ours['previous token'])} and {fmt(ours['induction'])}), and its classes hold {share} share "
        "of its heads."
    )


PROSE: dict[tuple[str, str], Callable[[Numbers], str]] = {
    ("ioi", "shape"): ioi_shape,
}

PROSE_OF_FILES: dict[tuple[str, str], Callable[[dict[str, Numbers]], str]] = {
    ("ioi+ioi-gemma3-270m", "depths"): ioi_depths,
}
