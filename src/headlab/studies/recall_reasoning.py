"""study=recall_reasoning (short form: ablate=circuits), the recall vs reasoning study (arXiv
2510.03366): component ablations, neuron groups, patching, classes, knockouts.

1. Ablate (ablate.method: zero | mean) every head, every layer's attention output and MLP output, and MLP
   neurons in groups: per layer, the neurons ranked by mean activation on recall prompts minus on
   reasoning prompts (at the answer position), the top groups of each sign. Activation-patch every head's
   z at the answer position from the counterfactual prompt of the same kind, and from the paired prompt
   of the other kind (recall <-> reasoning, group "other_kind"). All through the core engine, per prompt.
2. Per component (ablations, and heads patched from the other kind): recall and reasoning accuracy drops
   with paired bootstrap intervals, selectivity, class (analysis/selectivity.py).
3. Knockouts: the top-k recall components and the top-k reasoning components (heads and MLPs) ablated
   together, k = 1..knockout_k, against k components drawn at random (knockout_draws draws).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .. import results
from ..analysis.selectivity import drops, top_components
from ..config import Config, option, run_info
from ..errors import UsageError
from ..interventions import CLEAN, Intervention
from ..interventions.engine import execute, execute_joint
from ..models.hooked import HookedModel
from ..tasks import Task, TaskData
from ..tasks.recall_reasoning import other_kind
from .context import RunContext
from .study import Study
from .summary import head_table

NEURON_GROUP = 16  # neurons per group
NEURON_GROUPS = 2  # groups per sign and layer
KNOCKOUT_K = 10
KNOCKOUT_DRAWS = 5
OTHER_KIND = "other_kind"  # the group of the heads patched from the paired prompt of the other kind


def run(ctx: RunContext) -> pd.DataFrame:
    data = ctx.get_data()
    if "kind" not in data.answers:
        raise UsageError(
            f"ablate=circuits needs a task with recall and reasoning prompts, not task={ctx.cfg.task.name} "
            "(study=recall_reasoning)"
        )
    with ctx.timed("circuits"):
        df, extra = measure(ctx.cfg, ctx.get_model(), ctx.get_task(), data, run_info(ctx.cfg), ctx.show_progress)
    ctx.meta.update({**extra, "n_prompts": data.n, "model_family": ctx.get_model().family})
    return df


def component_label(iv: Intervention) -> str:
    if iv.intervention in ("ablate_head", "patch_head"):
        return f"L{iv.layer}H{iv.head}"
    if iv.intervention == "ablate_layer":
        return f"L{iv.layer} attn"
    if iv.intervention == "ablate_mlp":
        return f"L{iv.layer} MLP"
    return f"L{iv.layer} {iv.group}"


def neuron_groups(model: HookedModel, data: TaskData, method: str) -> list[Intervention]:
    """Per layer with an MLP: groups of neurons most active on recall (resp. reasoning) prompts."""
    kind = data.answers["kind"]
    rows = torch.arange(data.n)
    out = []
    with torch.inference_mode():
        recorded = model.record(data.inputs, "neurons")
    for layer, acts in sorted(recorded.items()):
        at_read = acts[rows, data.positions[:, 0]].float()  # [n, d_mlp]
        diff = at_read[kind == 0].mean(0) - at_read[kind == 1].mean(0)
        for sign, name in ((1, "recall"), (-1, "reasoning")):
            order = (sign * diff).argsort(descending=True)
            for g in range(NEURON_GROUPS):
                ids = tuple(int(i) for i in order[g * NEURON_GROUP : (g + 1) * NEURON_GROUP])
                out.append(
                    Intervention(
                        "ablate_neurons",
                        method,
                        layer,
                        neurons=ids,
                        group=f"neurons {name} {g * NEURON_GROUP + 1}-{(g + 1) * NEURON_GROUP}",
                    )
                )
    return out


def plan(
    model: HookedModel, data: TaskData, method: str
) -> tuple[list[Intervention], list[Intervention], list[Intervention]]:
    """(ablations, patches from the same kind's counterfactual, patches from the other kind); the clean
    run is not included."""
    layers, heads = range(model.n_layers), range(model.n_heads)
    ablations = [Intervention("ablate_head", method, l, h) for l in layers for h in heads]
    ablations += [
        Intervention(kind, method, l)
        for l in layers
        for kind in ("ablate_layer", "ablate_mlp")
        if kind != "ablate_mlp" or model.mlps[l] is not None
    ]
    if any(m is not None for m in model.mlps):
        ablations += neuron_groups(model, data, method)
    patch = lambda group: [
        Intervention("patch_head", "activation", l, h, token="ANSWER", group=group)  # noqa: E731
        for l in layers
        for h in heads
    ]
    return ablations, [] if data.counterfactual is None else patch(None), patch(OTHER_KIND)


def measure(
    cfg: Config, model: HookedModel, task: Task, data: TaskData, info: dict, show_progress: bool = False
) -> tuple[pd.DataFrame, dict]:
    """The study's table and its meta.json counts (classes per component kind)."""
    method = option(cfg.ablate.method)
    ablations, patches, crossed = plan(model, data, method)
    answers = data.answers_np()
    tables: list[pd.DataFrame] = []
    drop_tables: list[pd.DataFrame] = []
    # (prompts, interventions, those measured as accuracy drops: listed first); same-kind patches change
    # the answer, so they get no drops. Each pass runs clean first; its rows are kept once.
    passes = ((data, [*ablations, *patches], ablations), (other_kind(data), crossed, crossed))
    for edited, ivs, measured in passes:
        singles = [CLEAN, *ivs]
        quantities = (
            execute(
                model,
                task,
                edited,
                singles,
                cfg.engine.chunk_mb,
                cfg.engine.naive,
                show_progress=show_progress,
                seed=cfg.seed,
            )
            .cpu()
            .numpy()
        )
        table = results.tidy(
            info,
            [iv.row() for iv in singles],
            quantities,
            task.quantities,
            answers,
            task.aggregates,
            n_boot=cfg.output.n_boot,
        )
        names = [None] + [component_label(iv) for iv in ivs]
        table["component"] = pd.array(names * (len(table) // len(singles)), dtype="string")  # tidy is metric-major
        tables.append(table[table["intervention"] != "none"] if tables else table)
        labels = [{**iv.row(), "component": component_label(iv)} for iv in measured]
        drop_tables.append(
            drops(
                quantities[: 1 + len(measured), :, 0], answers["kind"], labels, n_boot=cfg.output.n_boot, seed=cfg.seed
            )
        )
    per_component, cross_drops = drop_tables
    knockouts = _knockouts(cfg, model, task, data, ablations, per_component, show_progress)
    frames = [
        *tables,
        _drop_rows(pd.concat(drop_tables, ignore_index=True), info, data.n),
        _knockout_rows(knockouts, info),
    ]
    df = results.conform(pd.concat(frames, ignore_index=True))
    return df, {
        "classes": per_component["class"].value_counts().to_dict(),
        "n_components": len(per_component),
        "other_kind_patching_classes": cross_drops["class"].value_counts().to_dict(),
    }


def _drop_rows(per_component: pd.DataFrame, info: dict, n: int) -> pd.DataFrame:
    rows = []
    keep = ["intervention", "method", "layer", "head", "hook", "group", "component"]
    for _, r in per_component.iterrows():
        base = {k: r[k] for k in keep if k in r and not pd.isna(r[k])}
        for kind in ("recall", "reasoning"):
            rows.append(
                {
                    **base,
                    "metric": f"drop_{kind}",
                    "value": r[f"drop_{kind}"],
                    "n": n,
                    "ci_low": r[f"drop_{kind}_low"],
                    "ci_high": r[f"drop_{kind}_high"],
                    "class": r["class"],
                }
            )
        rows.append({**base, "metric": "selectivity", "value": r["selectivity"], "n": n, "class": r["class"]})
    return pd.DataFrame(rows).assign(**info)


def _knockouts(
    cfg: Config,
    model: HookedModel,
    task: Task,
    data: TaskData,
    ablations: list[Intervention],
    per_component: pd.DataFrame,
    show_progress: bool,
) -> list[dict]:
    """Joint ablation of the top-k recall / reasoning components and of k random ones."""
    pool = [i for i, iv in enumerate(ablations) if iv.intervention in ("ablate_head", "ablate_mlp")]
    table = per_component.iloc[pool].assign(index=pool)
    groups, labels = [], []
    rng = np.random.default_rng(cfg.seed)
    k_max = min(KNOCKOUT_K, len(pool))
    for k in range(1, k_max + 1):
        for kind in ("recall", "reasoning"):
            chosen = top_components(table, kind, k)
            if len(chosen) == k:
                groups.append([ablations[i] for i in chosen["index"]])
                labels.append({"method": f"{kind}_top", "k": k, "draw": 0})
        for d in range(KNOCKOUT_DRAWS):
            groups.append([ablations[pool[i]] for i in rng.choice(len(pool), size=k, replace=False)])
            labels.append({"method": "random", "k": k, "draw": d})
    quantities = execute_joint(model, task, data, [[]] + groups, show_progress=show_progress, seed=cfg.seed)
    q = quantities.cpu().numpy()
    answers = data.answers_np()
    out = []
    for label, qi in zip([{"method": "clean", "k": 0, "draw": 0}] + labels, q):
        out.append({**label, **{m: float(f(qi[None], answers)[0]) for m, f in task.aggregates.items()}})
    return out


def _knockout_rows(knockouts: list[dict], info: dict) -> pd.DataFrame:
    df = pd.DataFrame(knockouts)
    rows = []
    for (method, k), g in df.groupby(["method", "k"]):
        for metric in ("recall_acc", "reasoning_acc"):
            values = g[metric].to_numpy()
            rows.append(
                {
                    "intervention": "knockout",
                    "method": method,
                    "k": int(k),
                    "metric": metric,
                    "value": float(values.mean()),
                    "n": len(values),
                    "ci_low": float(values.min()) if len(values) > 1 else np.nan,
                    "ci_high": float(values.max()) if len(values) > 1 else np.nan,
                }
            )
    out = pd.DataFrame(rows).assign(**info)
    out["k"] = out["k"].astype("Int64")
    return out


STUDY = Study(
    name="recall_reasoning",
    description="recall vs reasoning (arXiv 2510.03366): component drops, selectivity, classes, knockouts",
    run=run,
    summary=head_table,
    reads=("model", "task", "train", "ablate", "engine"),
    sections=("ablate",),
    implied_by=(("ablate", "circuits", "sweep"),),
)
