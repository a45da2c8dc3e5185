"""`headlab run study=ioi_classes task=ioi`: Wang et al. 2022's head classes by the paper's procedure,
path patching round by round from the logits back (analysis/ioi_classes.py states the rounds and rules).

Rows:
  clean              intervention "none", method "none": the task's quantities (logit_diff, io_prob, accuracy)
  per round          intervention "path_patch", method "path", receivers "logits" or the previous class's
                     heads ("9.6 9.9"), site q | v | k: every head before the last receiver as a sender,
                     its z from the ABC prompts (the task's reference set)
  head scores        intervention "none", method "score": analysis/scores.py's score_table (repeated random
                     tokens, and END attention / copy scores on the IOI prompts)
meta.json holds the classes found, the rule of each and the receivers of each round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from rich.table import Table

from .. import results
from ..analysis.ioi_classes import CLASS_METHOD, CLASSES, CLASSES_OF_ROUND, ROUNDS, TAU, classify, receivers_of, rules
from ..analysis.scores import has_ioi_roles, score_table
from ..config import run_info
from ..config_rules import Range, setting
from ..errors import UsageError
from ..interventions import CLEAN, Intervention
from ..interventions.engine import execute
from ..tables import score_grids
from ..vocabulary import Kind, Method, Site, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import console


@dataclass
class IOIClassesOptions(StudyOptions):
    name: str = "ioi_classes"
    # a class holds the heads whose path effect is at least this share of the clean logit difference
    tau: float = setting(TAU, Range(0, 1, low_open=True, high_open=True))


def run(ctx: RunContext) -> pd.DataFrame:
    cfg = ctx.cfg
    opts: IOIClassesOptions = ctx.options
    task, model, data = ctx.get_task(), ctx.get_model(), ctx.get_data()
    if not has_ioi_roles(data) or data.reference is None:
        raise UsageError(f"study=ioi_classes needs IOI prompts with ABC references (task=ioi), not task={task.name}")
    info = run_info(cfg)
    with ctx.timed("head_scores"):
        scores_df = score_table(model, data, info, n_boot=cfg.output.n_boot, seed=cfg.seed)
    shape = (model.n_layers, model.n_heads)
    scores = score_grids(scores_df, shape)
    found: dict[str, list[str]] = {}
    effects: dict[str, np.ndarray] = {}
    frames: list[pd.DataFrame] = [scores_df]
    clean: float | None = None
    receivers_used: dict[str, str] = {}
    for round_, (_, site) in ROUNDS.items():
        receivers = receivers_of(round_, found)
        if not receivers:
            ctx.note(f"path patching into {ROUNDS[round_][0]} heads skipped: that class is empty")
            break
        last = max((int(r.split(".")[0]) for r in receivers if r != "logits"), default=model.n_layers)
        spelled = " ".join(receivers)
        senders = [
            Intervention(Kind.path_patch, Method.path, layer, head, site=site, receivers=spelled)
            for layer in range(min(last, model.n_layers))
            for head in range(model.n_heads)
        ]
        ivs = [CLEAN, *senders] if clean is None else senders
        with ctx.timed(f"path_patching_{round_}"):
            patched = execute(
                model,
                task,
                data,
                ivs,
                cfg.engine.chunk_mb,
                show_progress=ctx.show_progress,
                seed=cfg.seed,
                gpu_memory_share=cfg.engine.gpu_memory_share,
            )
            quantities = patched.cpu().numpy()
        if clean is None:
            clean = float(quantities[0, :, task.quantities.index("logit_diff")].mean())
        rows = [iv.row() for iv in ivs]
        frames.append(
            results.tidy(info, rows, quantities, task.quantities, data.answers_np(), task.aggregates, cfg.output.n_boot)
        )
        effect = np.full(shape, np.nan)
        for iv, q in zip(ivs[len(ivs) - len(senders) :], quantities[len(ivs) - len(senders) :]):
            effect[iv.layer, iv.head] = q[:, task.quantities.index("logit_diff")].mean() - clean
        effects[round_] = effect
        receivers_used[round_] = spelled
        found = classify(effects, scores, clean, opts.tau)
    frames.append(_class_rows(found, effects, info, data.n))
    ctx.meta.update(
        {
            "classes": {cls: found[cls] for cls in CLASSES if cls in found},
            "rules": rules(opts.tau),
            "tau": opts.tau,
            "clean_logit_diff": clean,
            "receivers": receivers_used,
            "n_prompts": data.n,
            "model_family": model.family,
        }
    )
    return results.conform(pd.concat(frames, ignore_index=True))


def _class_rows(found: dict[str, list[str]], effects: dict[str, np.ndarray], info: dict, n: int) -> pd.DataFrame:
    """A row per head of a class (method "ioi_class", group: the class), its value the path-patching effect
    on the logit difference in the round that put it there."""
    round_of = {cls: round_ for round_, (_, _) in ROUNDS.items() for cls in CLASSES_OF_ROUND[round_]}
    rows = []
    for cls, heads in found.items():
        for name in heads:
            layer, head = map(int, name.split("."))
            value = float(effects[round_of[cls]][layer, head])
            rows.append(
                {
                    **info,
                    "intervention": "none",
                    "method": CLASS_METHOD,
                    "layer": layer,
                    "head": head,
                    "hook": hook_name(Site.z, layer),  # the value is its path-patching effect, a patch of its z
                    "group": cls,
                    "metric": "path_effect",
                    "value": value,
                    "n": n,
                }
            )
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """The classes the table's rows give, with each head's effect in the round that found it."""
    rows = df[df["method"] == CLASS_METHOD]
    clean = df[(df["intervention"] == "none") & (df["method"] == "none") & (df["metric"] == "logit_diff")]
    title = f"{df['model'].iloc[0]}: Wang et al.'s head classes by path patching"
    if len(clean):
        r = clean.iloc[0]
        title += f" (clean logit diff {r['value']:.2f}, 95% CI {r['ci_low']:.2f}..{r['ci_high']:.2f})"
    table = Table(title=title)
    for col in ("class", "heads (path-patching effect on the logit diff)"):
        table.add_column(col)
    for cls in CLASSES:
        part = rows[rows["group"] == cls]
        cells = [f"{int(r.layer)}.{int(r.head)} ({r.value:+.2f})" for r in part.itertuples()][:max_rows]
        table.add_row(cls, ", ".join(cells) or "-")
    console.print(table)


STUDY = Study(
    name="ioi_classes",
    description="Wang et al.'s IOI head classes by their procedure: path patching from the logits back",
    run=run,
    summary=summary,
    reads=("model", "task", "train", "engine"),
    figures="ioi",
    schema=IOIClassesOptions,
)
