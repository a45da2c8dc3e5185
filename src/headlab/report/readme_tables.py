"""How each README reproduction table is drawn from its numbers file (report/numbers.py puts them in place).

TABLES maps (reproduction, table) to a function of the parsed numbers.json returning Markdown. A cell
reads its numbers by their keys in that file, so a key a reproduction stops writing shows as "n/a".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Numbers = dict[str, Any]


def fmt(x: Any, digits: int = 2) -> str:
    if isinstance(x, bool) or x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "n/a"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def signed(x: Any, digits: int = 2) -> str:
    return f"{x:+.{digits}f}" if isinstance(x, float) and math.isfinite(x) else fmt(x, digits)


def get(numbers: Numbers, path: str) -> Any:
    """numbers["a"]["b"] for "a.b"; None where a key is missing."""
    node: Any = numbers
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def header(*names: str) -> str:
    return row(*names) + "\n" + row(*("---" for _ in names))


# --- count01 -------------------------------------------------------------------------------------------

OBJECTIVES = ("all", "decision")
# (claim key in verdicts, what the row shows, the numbers' keys shown in it, " / " between them)
COUNT01_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "pseudo_ensemble",
        "share of heads alone with ROC AUC >= 0.9 / label acc >= 0.9; mean [EOS] acc alone",
        (
            "frac_heads_alone_roc_auc_ge_0.9_zero",
            "frac_heads_alone_label_acc_ge_0.9_zero",
            "mean_head_alone_eos_acc_zero",
        ),
    ),
    (
        "nonuniform_for_syntax",
        "[EOS] acc: learned / equal norms at y / mean of head logits / best head alone",
        ("learned_eos_acc", "uniform_norm_at_eos_eos_acc", "mean_logits_eos_acc", "best_head_eos_acc"),
    ),
    (
        "",
        "label acc: learned / equal norms at SEP / mean of head logits",
        ("learned_label_acc", "uniform_norm_at_sep_label_acc", "mean_logits_label_acc"),
    ),
    (
        "",
        "learned head-norm spread max/min at SEP / at y",
        ("head_norm_max_over_min_at_sep", "head_norm_max_over_min_at_eos"),
    ),
    (
        "pattern_over_values",
        "value swap vs pattern head / values head alone: ROC AUC Pearson",
        ("value_swap_roc_auc_pearson_with_pattern_head_alone", "value_swap_roc_auc_pearson_with_values_head_alone"),
    ),
    (
        "pattern_over_ov",
        "pattern x OV vs pattern head / OV head alone: ROC AUC Pearson",
        ("pattern_ov_roc_auc_pearson_with_pattern_head_alone", "pattern_ov_roc_auc_pearson_with_ov_head_alone"),
    ),
    (
        "",
        "pattern x OV vs pattern head / OV head alone: mean \\|diff\\| of ROC AUC",
        ("pattern_ov_roc_auc_mean_abs_diff_to_pattern_head_alone", "pattern_ov_roc_auc_mean_abs_diff_to_ov_head_alone"),
    ),
    ("balance_w01", "r(ROC AUC alone, \\|w0 - w1\\| / (w0 + w1))", ("r_roc_auc_vs_imbalance",)),
    (
        "suppress_w02",
        "noise_ratio median / mean; r(ROC AUC alone, noise_ratio)",
        ("median_noise_ratio", "mean_noise_ratio", "r_roc_auc_vs_noise_ratio"),
    ),
)


def seeds_cell(numbers: Numbers, keys: tuple[str, ...]) -> str:
    """Each number pooled over seeds, then the mean over seeds with its 95% t interval in brackets."""
    parts = []
    for key in keys:
        over = (numbers.get("over_seeds") or {}).get(key)  # keys hold dots ("..._ge_0.9_zero")
        spread = f" [{fmt(over['ci_low'])}, {fmt(over['ci_high'])}]" if over else ""
        parts.append(fmt(numbers.get(key)) + spread)
    return " / ".join(parts)


def verdict_word(numbers: Numbers, claim: str) -> str:
    said = get(numbers, f"verdicts.{claim}.verdict")
    return said.split(" (")[0] if isinstance(said, str) else "n/a"


def count01_claims(numbers: Numbers) -> str:
    lines = [header("paper claim", "measure (numbers.json)", "loss all", "loss decision", "verdict all / decision")]
    for claim, measure, keys in COUNT01_ROWS:
        said = " / ".join(verdict_word(numbers.get(o, {}), claim) for o in OBJECTIVES) if claim else ""
        lines.append(
            row(
                get(numbers, f"all.verdicts.{claim}.claim") or "" if claim else "",
                measure,
                *(seeds_cell(numbers.get(o, {}), keys) for o in OBJECTIVES),
                said,
            )
        )
    return "\n".join(lines)


# --- ioi ----------------------------------------------------------------------------------------------

# MIB's EAP-IG (inputs) on IOI (Mueller et al. 2025, arXiv 2504.13151): the numbers a reader compares with
MIB_IOI = {"GPT-2": (1.85, 0.03), "Qwen-2.5": (1.63, 0.02)}


def with_ci(value: Any, ci: Any, digits: int = 3) -> str:
    spread = f" [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]" if isinstance(ci, list) and len(ci) == 2 else ""
    return fmt(value, digits) + spread


def ioi_model(numbers: Numbers) -> Numbers:
    """The smollm2-135m part of an IOI numbers file (a file of several models holds each under models)."""
    models = numbers.get("models")
    if isinstance(models, dict):
        return next((v for k, v in models.items() if "smollm2" in k), next(iter(models.values()), {}))
    return numbers


def ioi_circuit(numbers: Numbers) -> str:
    n = ioi_model(numbers)
    h = n.get("headline", {})
    edges, ungrouped = _int(h.get("graph_edges_eap_ig")), _int(h.get("graph_edges_ungrouped_eap_ig"))
    lines = [header("EAP-IG (MIB's convention)", "smollm2-135m", "MIB, EAP-IG (inputs)")]
    mib = "; ".join(f"{m} {cpr} / {cmd}" for m, (cpr, cmd) in MIB_IOI.items())
    lines.append(
        row(
            "CPR / CMD [95% bootstrap interval over prompts]",
            with_ci(h.get("cpr_eap_ig"), h.get("cpr_ci_eap_ig"))
            + " / "
            + with_ci(h.get("cmd_eap_ig"), h.get("cmd_ci_eap_ig")),
            mib,
        )
    )
    target, target_u = h.get("target_edges_eap_ig"), h.get("target_edges_ungrouped_eap_ig")
    share = lambda k, total: f" ({fmt(100 * k / total, 1)}%)" if isinstance(k, (int, float)) and total else ""  # noqa: E731
    if edges == ungrouped:  # study.kv_edges=ungrouped (or no GQA): one graph, MIB's
        lines.append(row("edges in the graph (each query head's own key and value inputs, as MIB's)", fmt(edges), ""))
        lines.append(row("smallest circuit reaching 80% of the gap", f"{fmt(_int(target))}{share(target, edges)}", ""))
    else:  # study.kv_edges=grouped: one key and value input per key/value head, counted both ways
        lines.append(
            row(
                "edges in the graph: ungrouped (MIB's count) / grouped (one per key/value head)",
                f"{fmt(ungrouped)} / {fmt(edges)}",
                "",
            )
        )
        lines.append(
            row(
                "smallest circuit reaching 80% of the gap: ungrouped / grouped edges",
                f"{fmt(_int(target_u))}{share(target_u, ungrouped)} / {fmt(_int(target))}{share(target, edges)}",
                "",
            )
        )
    conv = [h.get(f"convergence_{k}_eap_ig") for k in ("pearson", "top_1pct_kept", "max_change_over_max_score")]
    lines.append(
        row(
            "scores at m vs 2m steps: Pearson r / share of the top 1% kept / largest change over largest score",
            " / ".join(fmt(v, 3) for v in conv),
            "",
        )
    )
    return "\n".join(lines)


# Wang et al.'s GPT-2 small heads per class (figures/ioi_classes.py PAPER), in the paper's order
IOI_CLASSES = (
    "name mover",
    "negative name mover",
    "backup name mover",
    "S-inhibition",
    "induction",
    "duplicate token",
    "previous token",
)


def ioi_classes(numbers: Numbers) -> str:
    """Each class's heads with their path-patching effect and the share of prompt resamples keeping them."""
    n = ioi_model(numbers)
    classes = n.get("head_classes", {})
    effects = classes.get("path_effects", {})
    shares = {**classes.get("class_shares", {}), **classes.get("unclassed", {})}
    paper = get(n, "headline.paper_gpt2_small.classes") or {}

    def heads(cls: str) -> str:
        found = (classes.get("found") or {}).get(cls) or list(effects.get(cls, {}))
        cells = [f"{h} ({signed(effects.get(cls, {}).get(h))}; {fmt(shares.get(cls, {}).get(h), 2)})" for h in found]
        return ", ".join(cells) or "none"

    lines = [
        header(
            "class",
            "smollm2-135m: head (path effect; share of resamples keeping the class)",
            "GPT-2 small (Wang et al.)",
        )
    ]
    prompts = n.get("clean_n_prompts")
    lines.append(
        row(f"clean logit difference IO - S ({prompts} prompts)", fmt(get(n, "headline.clean_logit_diff"), 2), "3.56")
    )
    for cls in IOI_CLASSES:
        lines.append(row(cls, heads(cls), ", ".join(paper.get(cls, [])) or ""))
    for group in sorted(g for g in effects if g.startswith("unclassed")):
        lines.append(row(group + ": effect past tau, no class's attention", heads(group), ""))
    ablated = get(n, "ablation_mean.z@all") or []
    moved = ", ".join(f"{a['head']} ({fmt(a['value'], 2)})" for a in ablated)
    lines.append(
        row(
            "mean ablation (ABC means per template): the 5 heads moving it most",
            moved or "n/a",
            "9.9, 9.6, 10.0 among the largest (Fig. 3)",
        )
    )
    return "\n".join(lines)


def ioi_models(files: dict[str, Numbers]) -> str:
    """The IOI reproduction of each numbers file (one model each) beside Wang et al.'s GPT-2 small and MIB."""
    models = {get(ioi_model(n), "model") or name: ioi_model(n) for name, n in files.items()}
    lines = [header("", *models, "GPT-2 small (Wang et al.; MIB for CPR / CMD)")]

    def per_model(label: str, cell: Callable[[Numbers], str], paper: str = "") -> None:
        lines.append(row(label, *(cell(n) for n in models.values()), paper))

    per_model(
        "clean logit difference IO - S (prompts)",
        lambda n: f"{fmt(get(n, 'headline.clean_logit_diff'))} ({fmt(n.get('clean_n_prompts'))})",
        "3.56",
    )
    paper = next((get(n, "headline.paper_gpt2_small.classes") for n in models.values()), None) or {}
    for cls in IOI_CLASSES:

        def heads(n: Numbers, cls: str = cls) -> str:
            classes = n.get("head_classes", {})
            effects = classes.get("path_effects", {}).get(cls, {})
            found = (classes.get("found") or {}).get(cls) or list(effects)
            return ", ".join(f"{h} ({signed(effects.get(h))})" for h in found) or "none"

        per_model(f"{cls}: heads (path effect)", heads, ", ".join(paper.get(cls, [])))
    gpt2 = MIB_IOI["GPT-2"]
    per_model(
        "EAP-IG CPR / CMD [95% interval]",
        lambda n: (
            with_ci(get(n, "headline.cpr_eap_ig"), get(n, "headline.cpr_ci_eap_ig"), 2)
            + " / "
            + with_ci(get(n, "headline.cmd_eap_ig"), get(n, "headline.cmd_ci_eap_ig"), 2)
        ),
        f"{gpt2[0]} / {gpt2[1]}",
    )

    def target(n: Numbers) -> str:
        k, total = get(n, "headline.target_edges_ungrouped_eap_ig"), get(n, "headline.graph_edges_ungrouped_eap_ig")
        share = f" ({fmt(100 * k / total, 1)}%)" if isinstance(k, (int, float)) and total else ""
        return f"{fmt(_int(k))} of {fmt(_int(total))}{share}"

    per_model("EAP-IG: smallest circuit reaching 80%, ungrouped edges of the graph", target)
    return "\n".join(lines)


def _int(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


# --- recall vs reasoning on pretrained models ------------------------------------------------------------


def recall_reasoning_models(files: dict[str, Numbers]) -> str:
    """`reproduce recall_reasoning_facts` of each numbers file (one model each) beside the paper's finding."""
    models = {n.get("model") or name: n for name, n in files.items()}
    lines = [header("", *models, "the paper (2510.03366)")]

    def per_model(label: str, cell: Callable[[Numbers], str], paper: str = "") -> None:
        lines.append(row(label, *(cell(n) for n in models.values()), paper))

    def acc(n: Numbers, kind: str) -> str:
        return with_ci(get(n, f"clean.{kind}_acc"), get(n, f"clean_ci.{kind}_acc"), 2)

    per_model(
        "question pairs; answered: recall / reasoning",
        lambda n: (
            f"{fmt(_int(n.get('n_prompts', 0) / 2))}; {fmt(get(n, 'answered.recall'))} / "
            f"{fmt(get(n, 'answered.reasoning'))}"
        ),
    )
    per_model(
        "clean accuracy: recall / reasoning [95% interval]", lambda n: f"{acc(n, 'recall')} / {acc(n, 'reasoning')}"
    )
    per_model(
        "components classed recall / reasoning / shared (of all ablated)",
        lambda n: (
            " / ".join(fmt(get(n, f"classes.{c}") or 0) for c in ("recall", "reasoning", "shared"))
            + f" (of {fmt(sum((n.get('classes') or {}).values()))})"
        ),
        "distinct recall and reasoning components",
    )
    per_model(
        "largest drop of one head: recall / reasoning (pp)",
        lambda n: f"{fmt(get(n, 'heads.max_recall_drop_pp'), 1)} / {fmt(get(n, 'heads.max_reasoning_drop_pp'), 1)}",
        f"up to {fmt(next(iter(models.values()), {}).get('paper_max_drop_pp'), 0)}",
    )
    for method, label in (
        ("recall_top", "top 3 recall components"),
        ("reasoning_top", "top 3 reasoning components"),
        ("random", "3 random components (mean over the draws)"),
    ):

        def drops(n: Numbers, m: str = method) -> str:
            at = f"knockout_{m}.3"
            return f"{fmt(get(n, at + '.recall_drop_pp'), 1)} / {fmt(get(n, at + '.reasoning_drop_pp'), 1)}"

        per_model(f"{label} knocked out: recall / reasoning drop (pp)", drops)
    return "\n".join(lines)


# --- head attribution ------------------------------------------------------------------------------------


def _classes_by_model(files: dict[str, Numbers]) -> dict[str, dict[str, str]]:
    """model -> {head name L{l}H{h}: its IOI class}, from the IOI numbers files among `files`."""
    found: dict[str, dict[str, str]] = {}
    for n in files.values():
        model = ioi_model(n)
        for cls, heads in (get(model, "headline.classes") or {}).items():
            for h in heads:
                layer, head = h.split(".")
                found.setdefault(str(model.get("model")), {})[f"L{layer}H{head}"] = cls
    return found


def head_attribution_cases(files: dict[str, Numbers]) -> str:
    """`reproduce head_attribution`'s splits, each head named with its class from `reproduce ioi`."""
    split = files["head_attribution"]
    classes = _classes_by_model({k: v for k, v in files.items() if k != "head_attribution"})
    lines = [
        header(
            "model: head (class by path patching)",
            "edge",
            "score, attention",
            "built by (query side) [95% interval of the first]",
            "built by (key side) [95% interval of the first]",
        )
    ]

    def side(parts: list) -> str:
        shown = [f"{name} {signed(v)}" for name, v, _, _ in parts]
        if parts:
            shown[0] += f" [{fmt(parts[0][2])}, {fmt(parts[0][3])}]"
        return ", ".join(shown)

    for case in split.get("cases", []):
        cls = classes.get(case["model"], {}).get(case["head"])
        lines.append(
            row(
                f"{case['model']}: {case['head']}" + (f" ({cls})" if cls else ""),
                case["edge"],
                f"{fmt(case['score'])}, {fmt(case['attention'])}",
                side(case["query"]),
                side(case["key"]),
            )
        )
    return "\n".join(lines)


def head_attribution_norms(numbers: Numbers) -> str:
    """How far the norms move when a removed component leaves them free, per model."""
    lines = [
        header(
            "model",
            "removals checked",
            "input norm's scale: median / largest change",
            "QK-norm's scales: median / largest change",
            "score's change, free against held, relative to held: median / largest",
        )
    ]
    pct = lambda n, k: f"{fmt(100 * n[k], 1)}%" if isinstance(n.get(k), (int, float)) else "none"  # noqa: E731
    for model, n in (numbers.get("free_norms") or {}).items():
        lines.append(
            row(
                model,
                fmt(n.get("removals")),
                f"{pct(n, 'norm_scale_change_median')} / {pct(n, 'norm_scale_change_max')}",
                f"{pct(n, 'qk_norm_scale_change_median')} / {pct(n, 'qk_norm_scale_change_max')}",
                f"{pct(n, 'score_change_vs_held_median')} / {pct(n, 'score_change_vs_held_max')}",
            )
        )
    return "\n".join(lines)


# --- markov -------------------------------------------------------------------------------------------

MARKOV_ROWS = (
    ("markov_paths", "theory", "four paths: theory"),
    ("markov_paths", "sample", "four paths: HMC samples"),
    ("markov_paths", "gd", "four paths: gradient descent"),
    ("markov_paths", "u_rel_error_sample_vs_theory", "four paths: \\|U_sample - U_theory\\| / \\|U_theory\\|"),
    ("markov_two_paths", "theory", "two paths, noisier: theory"),
    ("markov_two_paths", "sample", "two paths, noisier: HMC samples"),
)


def markov_accuracy(numbers: Numbers) -> str:
    """Accuracy against width (figures/markov.py's numbers; JSON keeps the widths as strings)."""
    widths = sorted({int(w) for e, m, _ in MARKOV_ROWS for w in (get(numbers, f"{e}.{m}") or {})})
    lines = [header("width N", *map(str, widths))]
    for experiment, method, label in MARKOV_ROWS:
        by_width = get(numbers, f"{experiment}.{method}") or {}
        lines.append(row(label, *(fmt(by_width.get(str(w)), 3) for w in widths)))
    gp = [
        row(f"{name}: GP limit, {what}", fmt(get(numbers, f"{experiment}.{method}"), 3))
        for experiment, name in (("markov_paths", "four paths"), ("markov_two_paths", "two paths, noisier"))
        for method, what in (
            ("gp", "all paths"),
            ("gp_good", "good path alone"),
            ("gp_good_denoising", "good + denoising paths"),
        )
        if get(numbers, f"{experiment}.{method}") is not None
    ]
    return "\n".join(lines) + "\n\n" + header("limit", "test accuracy") + "\n" + "\n".join(gp)


def markov_pruning(numbers: Numbers) -> str:
    """Kernel-label alignment, then pruning by score against random orders (theory accuracy)."""
    lines = [header("measure", "value")]
    for method in ("theory", "sample"):
        top5 = get(numbers, f"alignment.{method}.top5_sum_sq")
        if top5 is not None:
            lines.append(
                row(
                    f"alignment at N = {get(numbers, 'alignment.width')} ({method}): top-5 PCs' share of the label",
                    fmt(top5, 3),
                )
            )
    gp5 = get(numbers, "alignment.gp.top5_sum_sq")
    if gp5 is not None:
        lines.append(row("alignment, GP kernel: top-5 PCs' share of the label", fmt(gp5, 3)))
    pruning = numbers.get("pruning") or {}
    for method in ("theory", "sample", "gd"):
        part = pruning.get(method)
        if not isinstance(part, dict):
            continue
        by_score, random = part.get("acc_by_score", {}), part.get("acc_random_mean", {})
        for k in sorted(by_score, key=int):
            if int(k) > 0:
                lines.append(
                    row(
                        f"pruning at N = {pruning.get('width')}, {method}: {k} lowest-scored heads out / random order",
                        f"{fmt(by_score[k], 3)} / {fmt(random.get(k), 3)}",
                    )
                )
        lines.append(
            row(f"pruning, {method}: Spearman of score vs accuracy drop", fmt(part.get("score_vs_drop_spearman"), 2))
        )
    return "\n".join(lines)


# --- attn_sae -----------------------------------------------------------------------------------------

SAE_COLUMNS = (
    ("l0", "L0", 1),
    ("explained_variance", "EV", 3),
    ("ce_clean", "CE clean", 3),
    ("ce_zero_ablation", "CE z zeroed", 3),
    ("ce_loss_recovered", "CE recovered", 3),
    ("dead_fraction", "dead", 2),
    ("polysemantic_head_fraction", "polysemantic (source roles)", 2),
    ("polysemantic_random_fraction", "the same rule, features assigned at random", 2),
    ("context_class_polysemantic_head_fraction", "polysemantic (text classes)", 2),
    ("context_class_polysemantic_random_fraction", "text classes, at random", 2),
    ("polysemantic_dominated_head_fraction", "polysemantic (dominance rule)", 2),
)


def attn_sae_layers(numbers: Numbers) -> str:
    """Per layer, each architecture's SAE metrics (figures/attn_sae.py's <arch>_L<layer> numbers)."""
    keys = [k for k in numbers if "_L" in k and k.rsplit("_L", 1)[1].isdigit() and isinstance(numbers[k], dict)]
    archs = sorted({k.rsplit("_L", 1)[0] for k in keys if not k.startswith(("head_roles", "features"))})
    layers = sorted({int(k.rsplit("_L", 1)[1]) for k in keys})
    names = [f"{arch} {label}" for arch in archs for _, label, _ in SAE_COLUMNS]
    lines = [header("layer", *names)]
    for layer in layers:
        cells = [
            fmt(get(numbers, f"{arch}_L{layer}.{metric}"), digits)
            for arch in archs
            for metric, _, digits in SAE_COLUMNS
        ]
        lines.append(row(str(layer), *cells))
    return "\n".join(lines)


# --- retrieval heads ------------------------------------------------------------------------------------


def retrieval_models(numbers: Numbers) -> str:
    """`reproduce retrieval_wu`: each model's retrieval heads and its needle recall with heads masked, beside
    Wu et al.'s findings."""
    models = {k: v for k, v in numbers.items() if isinstance(v, dict) and "n_heads" in v}
    lines = [header("", *models, "Wu et al. (2404.15574)")]

    def per_model(label: str, cell: Callable[[Numbers], str], paper: str = "") -> None:
        lines.append(row(label, *(cell(n) for n in models.values()), paper))

    per_model(
        "heads scoring above 0.1 (share of all heads)",
        lambda n: (
            f"{fmt(n.get('heads_above_0.1_retrieval_score'))} of {fmt(n.get('n_heads'))} "
            f"({fmt(100 * (n.get('share_above_0.1_retrieval_score') or 0), 1)}%)"
        ),
        "3-6% of the heads of 6B-14B models",
    )
    per_model(
        "strongest head (its score)",
        lambda n: f"{n.get('top_head_retrieval_score', '')} ({fmt(n.get('top_value_retrieval_score'))})",
    )
    per_model(
        "heads masked together (share of all heads)",
        lambda n: f"{fmt(n.get('heads_masked'))} ({fmt(100 * (n.get('heads_masked') or 0) / n['n_heads'], 1)}%)",
        "their script's mask_topk; random heads drawn outside their top 100",
    )
    per_model("needle recall (ROUGE-1 on words), clean", lambda n: fmt(n.get("recall_clean")))
    per_model(
        "... with the top retrieval heads masked while decoding",
        lambda n: fmt(n.get("recall_top_masked")),
        "falls (the needle is lost)",
    )
    per_model(
        "... with as many random heads masked (mean of the draws)",
        lambda n: f"{fmt(n.get('recall_random_masked_mean'))} ({fmt(n.get('random_draws'))} draws)",
        "stays near clean",
    )
    return "\n".join(lines)


# --- ioi_audit -----------------------------------------------------------------------------------------

AUDIT_KINDS = (("resample", "resamples"), ("seed", "other draws"), ("templates", "template halves"),
               ("method", "methods"), ("steps", "2x steps"))  # fmt: skip


def audit_tests(n: Numbers) -> str:
    def one(test: str) -> str:
        t = n.get(test) or {}
        verdict = "rejected" if t.get("rejected") else "kept"
        return f"{test[:5]}. p {fmt(t.get('p_value'), 3)} ({verdict})" if t else f"{test[:5]}. n/a"

    return "; ".join(one(t) for t in ("equivalence", "independence", "minimality"))


def interval_cell(triple: Any) -> str:
    """[value, low, high] as "value [low, high]"."""
    triple = triple if isinstance(triple, list) and len(triple) == 3 else [None, None, None]
    return with_ci(triple[0], triple[1:] if triple[1] is not None else None, 2)


def ioi_audits(files: dict[str, Numbers]) -> str:
    """`reproduce ioi_audit` on each model: one row per audited circuit."""
    lines = [
        header(
            "model, circuit",
            "units (of)",
            "faithfulness",
            *(f"Jaccard over {label}: at its size; at the target" for _, label in AUDIT_KINDS),
            "best disjoint rival; margin [95%]", "Shi et al.'s tests (H0 kept / rejected at 0.05)",
        )
    ]  # fmt: skip
    for numbers in files.values():
        for model, audits in numbers.items():
            if model == "provenance" or not isinstance(audits, dict):
                continue
            for audited, n in audits.items():
                jaccards = [
                    f"{interval_cell(n.get(f'jaccard_{k}'))}; {fmt((n.get(f'jaccard_at_target_{k}') or [None])[0])}"
                    for k, _ in AUDIT_KINDS
                ]
                # numbers files from before the rival search scored again say nothing: their rivals were cut
                how = n.get("rival_scores", "cut")
                rival = f"{fmt(n.get('best_rival_faithfulness'))} ({how}); {interval_cell(n.get('margin'))}"
                rival += " (unique)" if n.get("unique") else " (not unique)"
                lines.append(
                    row(
                        f"{model}, {audited}", f"{fmt(n.get('size'))} ({fmt(n.get('units'))})",
                        fmt(n.get("faithfulness")), *jaccards, rival, audit_tests(n),
                    )
                )  # fmt: skip
    return "\n".join(lines)


# --- atlas ---------------------------------------------------------------------------------------------

# each class of the atlas's rules (atlas_rules.py), in the guide's order, and the heads the papers report
ATLAS_LITERATURE = (
    ("previous-token", "GPT-2 small: 2.2 and 4.11, early (Wang et al. 2022); the first layers of Olsson et al.'s"),
    ("duplicate-token", "GPT-2 small: 0.1, 0.10, 3.0, early (Wang et al. 2022)"),
    ("induction", "GPT-2 small: 5.5, 6.9 (Wang et al.), mid-depth; every model of Olsson et al. of 2 layers or more"),
    ("copy", "GPT-2 small's name movers 9.6, 9.9, 10.0 (Wang et al.), at 75-83% of the depth"),
    ("negative-copy", "GPT-2 small's negative name movers 10.7, 11.10 (Wang et al.), just after the name movers"),
    ("needle-copy", "not Wu et al. 2024's retrieval heads (3-6% of heads above 0.1 in 4K-100K-token haystacks, "
     "decoded): this screen's short cue prompts let induction heads copy the needle"),
    ("sink", "Gu et al. 2024: no sinks in the first layers, most heads after (Sink_1^0.3 at T = 64 over "
     "sequences: GPT2-XL 77.0%, Llama2-7B 92.5%)"),
    ("IOI-supporting", "the heads of Wang et al.'s circuit (path patching: `headlab reproduce ioi`)"),
    ("IOI-opposing", "GPT-2 small's negative name movers 10.7, 11.10 (ablating them raises it)"),
    ("loss-critical", ""),
)  # fmt: skip
ATLAS_SHOWN = 6  # heads named per cell, strongest first; the rest counted


def atlas_cell(found: Any, n_heads: Any, label: str) -> str:
    heads = (found or {}).get(label, {}).get("heads") or []
    if not heads:
        return "none"
    named = ", ".join(f"{name} {fmt(value)}" for name, value in heads[:ATLAS_SHOWN])
    more = f", and {len(heads) - ATLAS_SHOWN} more" if len(heads) > ATLAS_SHOWN else ""
    percent = 100 * len(heads) / n_heads if isinstance(n_heads, int) and n_heads else None
    share = "" if percent is None else f" ({fmt(percent, 0 if percent >= 10 else 1)}%)"
    return f"{len(heads)}{share}: {named}{more}"


def atlas_classes(numbers: Numbers) -> str:
    """`reproduce atlas`: each class's heads on each model (count, share, the strongest with the value of the
    score its rule reads) beside the heads the papers report."""
    models = numbers.get("models") or {}
    names = [f"{m} (of {fmt(n.get('n_heads'))} heads)" for m, n in models.items()]
    lines = [header("class (rule above)", *names, "comparable heads reported in the literature")]
    for label, literature in ATLAS_LITERATURE:
        cells = [atlas_cell(n.get("classes"), n.get("n_heads"), label) for n in models.values()]
        lines.append(row(label, *cells, literature))
    return "\n".join(lines)


TABLES: dict[tuple[str, str], Callable[[Numbers], str]] = {
    ("atlas", "classes"): atlas_classes,
    ("retrieval_wu", "models"): retrieval_models,
    ("ioi_audit", "audits"): lambda numbers: ioi_audits({"ioi_audit": numbers}),
    ("attn_sae", "layers"): attn_sae_layers,
    ("attn_sae_smollm2", "layers"): attn_sae_layers,
    ("attn_sae_smollm2-gemma3-270m", "layers"): attn_sae_layers,
    ("markov", "pruning"): markov_pruning,
    ("markov", "accuracy"): markov_accuracy,
    ("count01", "claims"): count01_claims,
    ("ioi", "circuit"): ioi_circuit,
    ("ioi", "classes"): ioi_classes,
    ("head_attribution", "norms"): head_attribution_norms,
}
# tables that set several numbers files side by side (a block named "a+b/table")
TABLES_OF_FILES: dict[tuple[str, str], Callable[[dict[str, Numbers]], str]] = {
    ("ioi+ioi-gemma3-270m", "models"): ioi_models,
    ("recall_reasoning_facts+recall_reasoning_facts-gemma3-270m", "models"): recall_reasoning_models,
    ("head_attribution+ioi+ioi-gemma3-270m", "cases"): head_attribution_cases,
    ("ioi_audit+ioi_audit-gemma3-270m", "audits"): ioi_audits,
}
