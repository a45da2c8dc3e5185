"""`headlab run study=ioi_classes task=ioi`: Wang et al. 2022's head classes by the paper's procedure,
path patching round by round from the logits back (analysis/ioi_classes.py states the rounds and rules,
interventions/path.py the two passes).

Rows:
  clean              intervention "none", method "none": the task's quantities (logit_diff, io_prob, accuracy)
  per round          intervention "path_patch", method "path", `token` the round's position (END, S2, S1+1),
                     receivers "logits" or the previous class's heads ("23.0 23.3"), site q | v | k: every
                     head before the last receiver as a sender, its z from the ABC prompts (the task's
                     reference set); the backup round's rows have group "name movers knocked out"
  knockout           intervention "ablate_head", method "mean", token END, group "name movers knocked out",
                     no layer: the task's quantities with the name movers mean-ablated (the backup round's
                     baseline)
  head scores        intervention "none", method "score": analysis/scores.py's score_table (repeated random
                     tokens, and END attention / copy scores on the IOI prompts), and the attention the
                     rules read on the IOI prompts (attn_s2_to_s1, attn_s2_to_s1_next, attn_s1_next_to_s1)
  classes            method "ioi_class", group the class (or "unclassed (<round>)"): metric path_effect (the
                     effect in the round that found the head) and class_share (its share of resamples of the
                     prompts that keep it there)
meta.json holds the classes, the unclassed heads, each head's share, the rules and each round's receivers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from rich.table import Table

from .. import results
from ..analysis.ioi_classes import (
    ATTENTION,
    CLASS_METHOD,
    CLASSES,
    KNOCKOUT,
    ROUNDS,
    TAU,
    UNCLASSED,
    class_shares,
    classify,
    receivers_of,
    role_attention,
    rules,
    with_s1_next,
)
from ..analysis.scores import has_ioi_roles, score_table
from ..config import run_info
from ..config_rules import OneOf, Range, setting
from ..errors import UsageError
from ..interventions import CLEAN, Intervention
from ..interventions.edits import Sources
from ..interventions.path import Held, path_patch, reference_z
from ..models.hooked import HookedModel
from ..runtime import chunk_budget_mb
from ..tasks import Task, TaskData, mean_of
from ..vocabulary import KV_SITES, Kind, Method, Site, Source, hook_name
from .context import RunContext
from .study import Study, StudyOptions
from .summary import console

RECEIVER_FORMS = ("head", "kv_group")
NEW_READS = ("attn_s2_to_s1", "attn_s2_to_s1_next", "attn_s1_next_to_s1")  # score_table has the END ones


@dataclass
class IOIClassesOptions(StudyOptions):
    name: str = "ioi_classes"
    # a class holds the heads whose path effect is at least this share of the clean logit difference
    tau: float = setting(TAU, Range(0, 1, low_open=True, high_open=True))
    # the attention a class's pattern needs on the IOI prompts (END to IO for the name movers, S2 to S1+1 for
    # the induction heads, ...; analysis/ioi_classes.py)
    min_attention: float = setting(ATTENTION, Range(0, 1, low_open=True))
    # head: a k or v receiver is its query head alone, its siblings on the shared key/value head clean;
    # kv_group: every query head that shares the receiver's key/value head receives (the shared k or v)
    receivers: str = setting("head", OneOf(RECEIVER_FORMS))


def run(ctx: RunContext) -> pd.DataFrame:
    cfg = ctx.cfg
    opts: IOIClassesOptions = ctx.options
    task, model, data = ctx.get_task(), ctx.get_model(), ctx.get_data()
    if not has_ioi_roles(data) or data.reference is None:
        raise UsageError(f"study=ioi_classes needs IOI prompts with ABC references (task=ioi), not task={task.name}")
    data = with_s1_next(data)
    info = run_info(cfg)
    ld = task.quantities.index("logit_diff")
    with ctx.timed("head_scores"):
        scores_df = score_table(model, data, info, n_boot=cfg.output.n_boot, seed=cfg.seed)
        reads = {name: t.numpy().astype(np.float64) for name, t in role_attention(model, data).items()}
    frames: list[pd.DataFrame] = [scores_df, _read_rows(reads, info, cfg.output.n_boot)]
    attention = {name: grid.mean(-1) for name, grid in reads.items()}
    budget = chunk_budget_mb(model.input_device, cfg.engine.chunk_mb, cfg.engine.gpu_memory_share)
    shape = (model.n_layers, model.n_heads)
    per_prompt: dict[str, np.ndarray] = {}  # round -> [layer, head, n] patched minus clean logit difference
    found: dict[str, list[str]] = {}
    used: dict[str, str] = {}
    clean = np.zeros(data.n)
    plain: Sources | None = None  # the reference run's z, which every round's senders send but the backup round's
    for round_ in ROUNDS:
        receivers = receivers_of(round_, found if round_.name != "backup" else {})
        held = _knockout(model, data, found.get("name mover", [])) if round_.name == "backup" else []
        if not receivers or (round_.name == "backup" and not held):
            ctx.note(f"path patching into {round_.into} skipped: no {round_.receivers or 'name mover'} heads")
            continue
        if opts.receivers == "kv_group" and round_.site in KV_SITES:
            receivers = _kv_groups(receivers, model)
        spelled = " ".join(receivers)
        last = max((int(r.split(".")[0]) for r in receivers if r != "logits"), default=model.n_layers)
        group = KNOCKOUT if held else None
        senders = [
            Intervention(
                Kind.path_patch, Method.path, l, h, token=round_.token, site=round_.site, receivers=spelled, group=group
            )
            for l in range(last)
            for h in range(model.n_heads)
        ]
        with ctx.timed(f"path_patching_{round_.name}"):
            if not held and plain is None:
                plain = reference_z(model, data, seed=cfg.seed)
            base, patched = path_patch(
                model, task, data, senders, held, budget, ctx.show_progress, cfg.seed, None if held else plain
            )
        quantities = torch.stack(patched).numpy()
        if round_.name == "logits":
            clean = base[:, ld].numpy().astype(np.float64)
            frames.append(_tidy(info, [CLEAN.row()], base[None].numpy(), task, data, cfg.output.n_boot))
        if held:
            row = {"intervention": Kind.ablate_head, "method": Method.mean, "token": round_.token, "group": KNOCKOUT}
            frames.append(_tidy(info, [row], base[None].numpy(), task, data, cfg.output.n_boot))
        frames.append(_tidy(info, [iv.row() for iv in senders], quantities, task, data, cfg.output.n_boot))
        effect = np.full((*shape, data.n), np.nan)
        for iv, q in zip(senders, quantities):
            effect[iv.layer, iv.head] = q[:, ld] - base[:, ld].numpy()
        per_prompt[round_.name] = effect
        used[round_.name] = spelled
        found = classify(
            {k: v.mean(-1) for k, v in per_prompt.items()}, attention, float(clean.mean()), opts.tau, opts.min_attention
        )
    with ctx.timed("class_shares"):
        shares = class_shares(
            per_prompt, reads, clean, found, opts.tau, opts.min_attention, max(cfg.output.n_boot, 1), cfg.seed
        )
    frames.append(_class_rows(found, shares, per_prompt, info, data.n))
    ctx.meta.update(
        {
            "classes": {cls: found[cls] for cls in CLASSES if cls in found},
            "unclassed": {r.name: found[UNCLASSED[r.name]] for r in ROUNDS if UNCLASSED[r.name] in found},
            "class_shares": shares,
            "resampled": "prompts, with replacement, one draw for every round and attention read, given the "
            "receivers all prompts gave (the model is not run again)",
            "rules": rules(opts.tau, opts.min_attention),
            "tau": opts.tau,
            "min_attention": opts.min_attention,
            "receiver_form": opts.receivers,
            "clean_logit_diff": float(clean.mean()),
            "receivers": used,
            "positions": {r.name: r.token for r in ROUNDS if r.name in used},
            "n_prompts": data.n,
            "model_family": model.family,
        }
    )
    return results.conform(pd.concat(frames, ignore_index=True))


def _tidy(
    info: dict, rows: list[dict], quantities: np.ndarray, task: Task, data: TaskData, n_boot: int
) -> pd.DataFrame:
    return results.tidy(info, rows, quantities, task.quantities, data.answers_np(), task.aggregates, n_boot)


def _read_rows(reads: dict[str, np.ndarray], info: dict, n_boot: int) -> pd.DataFrame:
    """Score rows (method "score") of the attention reads score_table does not make."""
    layers, heads, n = next(iter(reads.values())).shape
    labels = [
        {"intervention": "none", "method": "score", "layer": l, "head": h, "hook": hook_name(Site.pattern, l)}
        for l in range(layers)
        for h in range(heads)
    ]
    quantities = np.stack([reads[name].reshape(layers * heads, n) for name in NEW_READS], -1)
    metrics = {name: mean_of(j) for j, name in enumerate(NEW_READS)}
    return results.tidy(info, labels, quantities, NEW_READS, {}, metrics, n_boot)


def _kv_groups(receivers: list[str], model: HookedModel) -> list[str]:
    """Every query head that shares a receiver's key/value head, in layer, head order."""
    rep = model.n_heads // model.sites.n_kv_heads
    heads = {
        (l, g * rep + i) for l, h in (map(int, r.split(".")) for r in receivers) for g in [h // rep] for i in range(rep)
    }
    return [f"{l}.{h}" for l, h in sorted(heads)]


def _knockout(model: HookedModel, data: TaskData, heads: list[str]) -> list[Held]:
    """The name movers mean-ablated at END, as the authors knock them out (experiments.py, "Backup NM
    results"): each head's z there the mean over the ABC prompts of the prompt's template."""
    if not heads:
        return []
    end = (data.token_positions or {})["END"].cpu()
    with torch.inference_mode():
        sources = Sources(model, data, {(Source.mean, Site.z)})
        out = []
        for name in heads:
            layer, head = map(int, name.split("."))
            means, rows = sources.value(Source.mean, Site.z, layer)
            rows = rows.cpu()
            out.append(Held(layer, head, end, means.cpu()[rows, end, head].clone()))
    return out


def _class_rows(
    found: dict[str, list[str]],
    shares: dict[str, dict[str, float]],
    per_prompt: dict[str, np.ndarray],
    info: dict,
    n: int,
) -> pd.DataFrame:
    """Per head of a class (or unclassed): its effect in the round that found it and its class share."""
    round_of = {cls: r.name for r in ROUNDS for cls in r.classes} | {UNCLASSED[r.name]: r.name for r in ROUNDS}
    rows = []
    for cls, heads in found.items():
        for name in heads:
            layer, head = map(int, name.split("."))
            effect = float(np.nanmean(per_prompt[round_of[cls]][layer, head]))
            for metric, value in (("path_effect", effect), ("class_share", shares.get(cls, {}).get(name, np.nan))):
                rows.append(
                    {
                        **info,
                        "intervention": "none",
                        "method": CLASS_METHOD,
                        "layer": layer,
                        "head": head,
                        "hook": hook_name(Site.z, layer),  # the effect is of a patch of its z
                        "group": cls,
                        "metric": metric,
                        "value": value,
                        "n": n,
                    }
                )
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """The classes the table's rows give, each head with its path-patching effect and class share."""
    rows = df[df["method"] == CLASS_METHOD]
    clean = df[(df["intervention"] == "none") & (df["method"] == "none") & (df["metric"] == "logit_diff")]
    title = f"{df['model'].iloc[0]}: Wang et al.'s head classes by path patching"
    if len(clean):
        r = clean.iloc[0]
        title += f" (clean logit diff {r['value']:.2f}, 95% CI {r['ci_low']:.2f}..{r['ci_high']:.2f})"
    table = Table(title=title)
    for col in ("class", "heads (path-patching effect on the logit diff; share of resamples keeping the class)"):
        table.add_column(col)
    for cls in (*CLASSES, *UNCLASSED.values()):
        part = rows[rows["group"] == cls]
        if cls in UNCLASSED.values() and part.empty:
            continue
        effect = part[part["metric"] == "path_effect"].set_index(["layer", "head"])["value"]
        share = part[part["metric"] == "class_share"].set_index(["layer", "head"])["value"]
        cells = [f"{int(l)}.{int(h)} ({v:+.2f}; {share.get((l, h), np.nan):.2f})" for (l, h), v in effect.items()]
        table.add_row(cls, ", ".join(cells[:max_rows]) or "-")
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
