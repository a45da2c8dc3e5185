"""Count01 (arXiv 2502.06923): each claim of the paper, the measure this reproduction puts beside it, how
that measure differs from the paper's, and a verdict read off numbers.json.

The claims are worded after the paper's abstract and public summary (heads a pseudo-ensemble on the
semantics; non-uniform aggregation needed for the syntax, [EOS] after y; performance set by the attention
pattern, value vectors minor; good heads balance w_01 and suppress w_02; metrics l-acc, ROC AUC, s-acc).
A verdict says "agrees", "partly" or "does not agree" by the rule written in it, then the numbers.
"""

from __future__ import annotations

import math

SOURCE = (
    "claims worded after the paper's abstract and public summary; where this file says how a measure "
    "differs, it says what is measured here, not a reading of the paper's appendix"
)

CLAIMS = {
    "pseudo_ensemble": "on the semantics (the label), each head alone solves the task: a pseudo-ensemble",
    "nonuniform_for_syntax": "aggregating the heads uniformly keeps the label but breaks the syntax ([EOS] after y)",
    "pattern_over_values": "a head's performance follows its attention pattern; its value vectors matter little",
    "pattern_over_ov": "the same, asked the other way: a head's pattern on another head's whole OV circuit",
    "balance_w01": "good heads weigh a 0 and a 1 alike (w_01 balanced)",
    "suppress_w02": "good heads put little weight on the 2s (w_02 suppressed)",
}

MEASURES = {
    "pseudo_ensemble": (
        "each head alone (the other heads zero-ablated at every position; mean ablation beside): ROC AUC of its "
        "1-vs-0 logit difference at SEP >= 0.9, label acc >= 0.9, [EOS] acc at y; models of 2 heads and more",
        "the 0.9 threshold is ours; 'alone' is an ablation of the trained model, whose lone head keeps a constant "
        "offset (SEP, positions, b_O) that can sink label acc while ROC AUC stays high",
    ),
    "nonuniform_for_syntax": (
        "every head's output z_h W_O^h times one factor per head so that the heads' mean norms (over prompts) are "
        "equal, measured and applied at y, where [EOS] is decided ([EOS] acc), and at SEP (label acc); the "
        "learned heads' norm spread max/min at SEP and at y; the mean of the heads' logits alone beside",
        "equal on average over prompts, not prompt by prompt; each head's direction is kept and the final "
        "LayerNorm renormalises the sum; the older row (norms at SEP applied everywhere) equalised nothing at y",
    ),
    "pattern_over_values": (
        "value swap V[j, i]: head i alone with its own pattern and W_O and head j's values v_j = x W_V^j; each "
        "off-diagonal ROC AUC against i alone (pattern head) and j alone (values head): Pearson, mean |diff|",
        "v_j is read through W_O^i, a pairing never trained together, so a swap can fail for that alone; "
        "fig_pattern_ov moves the whole OV circuit (values and W_O) instead",
    ),
    "pattern_over_ov": (
        "pattern x OV M[p, o]: head o alone with its own values and W_O on head p's pattern; each off-diagonal "
        "ROC AUC against p alone (pattern head) and o alone (OV head): Pearson, mean |diff|",
        "this swaps patterns and keeps each OV circuit whole; the value swap (fig_value_swaps) swaps the values",
    ),
    "balance_w01": (
        "|w0 - w1| / (w0 + w1), w0 (w1) the mean attention from SEP on one 0 (one 1), per head; Pearson with "
        "the head's ROC AUC alone over every head of every model",
        "a normalised gap between per-occurrence weights; the paper's w_01 is named, its form not matched here",
    ),
    "suppress_w02": (
        "noise_ratio: per prompt, attention from SEP on one 2 over that on one 1, averaged over prompts holding "
        "both, per head; its median and mean over heads, and its Pearson with the head's ROC AUC alone",
        "relative to a 1; the paper's name w_02 pairs the 2s with the 0s: noise_ratio_to_0 (one 2 over one 0) "
        "is reported beside",
    ),
}


def _word(agrees: bool, partly: bool, *values: float) -> str:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return "no data"
    return "agrees" if agrees else "partly" if partly else "does not agree"


def _f(x: float) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.2f}"


def _follows(numbers: dict, prefix: str, other: str) -> tuple[str, str]:
    """Do the swaps' ROC AUCs follow the pattern head alone, or the other head alone?"""
    rp = numbers.get(f"{prefix}_roc_auc_pearson_with_pattern_head_alone", math.nan)
    ro = numbers.get(f"{prefix}_roc_auc_pearson_with_{other}_head_alone", math.nan)
    dp = numbers.get(f"{prefix}_roc_auc_mean_abs_diff_to_pattern_head_alone", math.nan)
    do = numbers.get(f"{prefix}_roc_auc_mean_abs_diff_to_{other}_head_alone", math.nan)
    word = _word(rp > max(ro, 0) and dp < do, rp > ro or dp < do, rp, ro, dp, do)
    said = f"r with pattern head {_f(rp)} vs {other} head {_f(ro)}; mean |diff| {_f(dp)} vs {_f(do)}"
    rule = "agrees: closer to the pattern head by r (r > 0) and by |diff|; partly: by one"
    return word, f"{word} ({rule}): {said}"


def verdicts(numbers: dict) -> dict:
    """claim -> {claim, measure, differs, verdict}, from one objective's numbers."""
    n = lambda key: numbers.get(key, math.nan)  # noqa: E731
    said: dict[str, str] = {}
    share, label = n("frac_heads_alone_roc_auc_ge_0.9_zero"), n("frac_heads_alone_label_acc_ge_0.9_zero")
    word = _word(share >= 0.75, share >= 0.25, share)
    said["pseudo_ensemble"] = (
        f"{word} (agrees: >= 75% of heads alone reach ROC AUC 0.9; partly: >= 25%): {share:.0%} do "
        f"({label:.0%} reach label acc 0.9; mean [EOS] acc alone {_f(n('mean_head_alone_eos_acc_zero'))})"
    )
    eos_drop = n("learned_eos_acc") - n("uniform_norm_at_eos_eos_acc")
    label_drop = n("learned_label_acc") - n("uniform_norm_at_sep_label_acc")
    word = _word(eos_drop >= 0.05 and label_drop < 0.05, eos_drop >= 0.05, eos_drop, label_drop)
    said["nonuniform_for_syntax"] = (
        f"{word} (agrees: equal norms at y cost >= 0.05 [EOS] acc and equal norms at SEP < 0.05 label acc): "
        f"[EOS] acc learned {_f(n('learned_eos_acc'))}, equal norms at y {_f(n('uniform_norm_at_eos_eos_acc'))}, "
        f"mean of head logits {_f(n('mean_logits_eos_acc'))}; label acc equal norms at SEP "
        f"{_f(n('uniform_norm_at_sep_label_acc'))}; learned norm spread max/min at SEP "
        f"{_f(n('head_norm_max_over_min_at_sep'))}, at y {_f(n('head_norm_max_over_min_at_eos'))}"
    )
    said["pattern_over_values"] = _follows(numbers, "value_swap", "values")[1]
    said["pattern_over_ov"] = _follows(numbers, "pattern_ov", "ov")[1]
    r = n("r_roc_auc_vs_imbalance")
    word = _word(r <= -0.3, r < 0, r)
    said["balance_w01"] = f"{word} (agrees: r <= -0.3; partly: r < 0): r(ROC AUC alone, |w0 - w1| / sum) = {_f(r)}"
    r, ratio = n("r_roc_auc_vs_noise_ratio"), n("median_noise_ratio")
    word = _word(ratio < 0.5 and r <= -0.3, ratio < 0.5 or r <= -0.3, ratio, r)
    said["suppress_w02"] = (
        f"{word} (agrees: median noise_ratio < 0.5 and r <= -0.3; partly: one): noise_ratio median {_f(ratio)}, "
        f"mean {_f(n('mean_noise_ratio'))} (heads solving "
        f"alone {_f(n('mean_noise_ratio_heads_solving'))}, the others {_f(n('mean_noise_ratio_heads_not_solving'))}"
        f"; to a 0: {_f(n('mean_noise_ratio_to_0'))}); r(ROC AUC alone, noise_ratio) = {_f(r)}"
    )
    return {
        key: {"claim": CLAIMS[key], "measure": MEASURES[key][0], "differs": MEASURES[key][1], "verdict": said[key]}
        for key in CLAIMS
    }


def footnote(fig, text: str, lines: int) -> None:
    """`text` under the axes of a matplotlib figure, which leaves it about `lines` lines."""
    fig.text(0.01, 0.01, text, fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, min(0.6, lines * 0.11 / fig.get_figheight()), 1, 1))


def caption(verdict: dict) -> str:
    """A figure's footnote: the claim, the verdict, what is measured and how it differs."""
    return (
        f"Paper: {verdict['claim']}.\nVerdict: {verdict['verdict']}.\n"
        f"Measured: {verdict['measure']}.\nDiffers: {verdict['differs']}."
    )
