"""The tables and printout of `headlab sae` (studies/sae.py): how token ids read as text, the context
class of every corpus position, each live feature's top-activating contexts, direct feature attribution
of the most frequent features, and the console summary."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from rich.table import Table

from ..models.hooked import HookedModel
from ..sae.activations import Corpus
from ..sae.contexts import text_classes, token_type
from ..sae.export import hook_name
from ..sae.head_attribution import direct_feature_attribution
from ..sae.source_roles import role_column
from ..tasks import Task
from .summary import aggregated, console

DFA_FEATURES = 8  # features whose top context is split by head and source position


def token_text(model: HookedModel, task: Task) -> Callable[[Any], str]:
    if model.tokenizer is not None:
        return lambda i: model.tokenizer.decode([int(i)])
    strings = getattr(task, "token_strings", None)
    if strings:
        return lambda i: strings[int(i)] + " "
    names = getattr(task, "token_names", None) or {}
    return lambda i: names.get(int(i), str(int(i))) + " "


def context_classes(
    task: Task, corpus: Corpus, text: Callable[[Any], str], is_text: bool = False
) -> tuple[torch.Tensor, tuple[str, ...]]:
    """([n, pos] class index of every corpus position, class names): for a text corpus the place of the
    token in the text (sae/contexts.py; its windows are consecutive, so they are classed as one text),
    else the task's roles where it defines them, else the type of the token at the position."""
    if is_text:
        grid, names = text_classes(corpus.ids.reshape(1, -1), text)
        return grid.view_as(corpus.ids), names
    own = getattr(task, "context_classes", None)
    found = own(corpus.ids) if own is not None else None
    if found is not None:
        return found
    tokens, inverse = corpus.ids.unique(return_inverse=True)
    types = [token_type(text(t)) for t in tokens.tolist()]
    names = tuple(sorted(set(types)))
    index = torch.tensor([names.index(t) for t in types])
    return index[inverse], names


def contexts_table(corpus: Corpus, locate, values, where, live, text, window: int) -> pd.DataFrame:
    rows = []
    for f in live.tolist():
        for rank in range(values.shape[0]):
            if values[rank, f] <= 0:
                break
            row, pos = locate[where[rank, f]].tolist()
            ids = corpus.ids[row, max(0, pos - window) : pos + 1].tolist()
            shown = "".join(text(t) for t in ids[:-1]) + "[[" + text(ids[-1]) + "]]"
            rows.append(
                {
                    "feature": f,
                    "rank": rank,
                    "activation": float(values[rank, f]),
                    "sequence": row,
                    "position": pos,
                    "token": text(ids[-1]),
                    "context": shown,
                }
            )
    return pd.DataFrame(rows, columns=["feature", "rank", "activation", "sequence", "position", "token", "context"])


def dfa_rows(model, layer, sae, corpus, locate, values, where, frequency, info) -> pd.DataFrame:
    frames = []
    for f in frequency.argsort(descending=True)[:DFA_FEATURES].tolist():
        if values[0, f] <= 0:
            continue
        row, pos = locate[where[0, f]].tolist()
        dfa = direct_feature_attribution(model, layer, sae, corpus.ids[row], pos, f)[:, : pos + 1]
        heads, sources = torch.meshgrid(torch.arange(dfa.shape[0]), torch.arange(dfa.shape[1]), indexing="ij")
        frames.append(
            pd.DataFrame(
                {
                    "head": heads.reshape(-1).numpy(),
                    "position": sources.reshape(-1).numpy(),
                    "value": dfa.reshape(-1).numpy(),
                    "feature": f,
                    "sequence": row,
                    "query_position": pos,
                }
            )
        )
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames).assign(**info, metric="dfa", n=1)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """Per layer: the SAE's metrics, then per head how many features it dominates and how polysemantic
    they are."""
    df = aggregated(df)
    sae_rows = df[(df["intervention"] == "sae") & (df["method"] != "fit")]
    if "feature" in sae_rows:
        sae_rows = sae_rows[sae_rows["feature"].isna()]
    for layer in sorted(sae_rows["layer"].dropna().unique()):
        _layer_summary(sae_rows[sae_rows["layer"] == layer], int(layer), max_rows)


def _layer_summary(df: pd.DataFrame, layer: int, max_rows: int) -> None:
    top = df[df["head"].isna()]
    if top.empty:
        return
    arch = top["method"].iloc[0]
    table = Table(
        title=f"{df['model'].iloc[0]}: {arch} SAE on {hook_name(layer)} ({int(top['n'].iloc[0])} held-out tokens)"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for _, r in top.iterrows():
        table.add_row(str(r["metric"]), f"{r['value']:.4f}")
    console.print(table)
    heads = df[df["head"].notna()]
    wide = heads.pivot_table(index="head", columns="metric", values="value", dropna=False)  # keeps nan overlaps
    if "polysemantic" not in wide or "n_top_features" not in wide:
        return  # a table written before head_roles
    in_role = heads[(heads["metric"] == "top_features_in_role") & (heads["value"] > 0)]
    table = Table(
        title="per head, its top features by decoder share (Kissane et al.'s reading): their roles (where their "
        "attention comes from, sae/source_roles.py) and whether two are unrelated; the old rule (dominated "
        "features, text classes) beside it"
    )
    columns = ("head", "top", "mean share", "roles", "least overlap", "polysemantic", "dominated", "old rule")
    for col in columns:
        table.add_column(col, justify="left" if col == "roles" else "right")
    for head, r in wide.head(max_rows).iterrows():
        mine = in_role[in_role["head"] == head].sort_values("value", ascending=False, kind="stable")
        table.add_row(
            str(int(head)),
            str(int(r["n_top_features"])),
            f"{r['top_feature_share']:.2f}",
            ", ".join(f"{c} {int(v)}" for c, v in zip(mine[role_column(mine)], mine["value"])),
            f"{r['min_class_overlap']:.2f}",
            "yes" if r["polysemantic"] else "no",
            str(int(r["n_dominated"])),
            "yes" if r.get("polysemantic_dominated", 0) else "no",
        )
    console.print(table)
