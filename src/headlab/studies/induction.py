"""`headlab run scores=induction`: induction heads (Olsson et al. 2022) on `study.n_sequences` sequences
of `study.repeat_len` distinct random ordinary tokens repeated once, BOS first (analysis/scores.py's
repeated_tokens, drawn with the run's seed), and their in-context learning score on real text
(`study.icl_text` cut into sequences of `study.icl_len` tokens); no task prompts are read.

Rows:
  per head      intervention "none", method "score", metrics prev_token_score, duplicate_token_score,
                induction_score (Olsson et al.'s prefix matching over the second copy) and induction_score_tl
                (TransformerLens's detect_head "induction_head": over all 2T+1 query rows), from
                analysis/scores.py's induction_scores, 95% bootstrap interval over sequences; the top
                heads are those of highest induction_score
  ablation      the clean run (intervention "none", method "none"), then intervention "ablate_head", method
                "zero", group "top{k}" (the `study.top_k` heads of highest induction score zero-ablated
                together) and "random{k}_{draw}" (`study.n_random` seeded draws of k heads outside the top
                max(k, `study.random_outside`)): metrics first_copy_loss, second_copy_loss,
                repeat_loss_drop (analysis/induction.py) and second_copy_loss_increase (ablated minus
                clean, paired over sequences); and on the text sequences, the same runs' loss_50th_token,
                loss_500th_token and icl_score (analysis/induction.py; left out, with a note, for a model
                without tokenizer or of fewer positions); `study.top_k=0` leaves this part out, the
                scores alone
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from rich.table import Table

from .. import results
from ..analysis.head_sets import avoided_heads, random_heads, top_heads
from ..analysis.induction import (
    ICL_QUANTITIES,
    REPEAT_QUANTITIES,
    ablated_icl_score,
    ablated_repeat_loss,
    icl_data,
    repeat_data,
    text_file,
    text_sequences,
)
from ..analysis.scores import SEQ_SCORES, induction_scores, ordinary_ids, repeated_tokens
from ..config import option, run_info
from ..config_rules import COUNT, at_least, setting
from ..errors import HeadlabError, UsageError
from ..models.hooked import HookedModel
from ..tables import head_name
from ..tasks import mean_of
from ..vocabulary import Site, hook_name
from .context import RunContext
from .retrieval import HeadSetOptions
from .study import Study
from .summary import aggregated, console

TOP_HEADS = 10  # named in meta.json


@dataclass
class InductionOptions(HeadSetOptions):
    name: str = "induction"
    # n_sequences sequences of repeat_len distinct random tokens, each repeated once after itself
    # (TransformerLens's and Olsson et al.'s repeated random tokens: 50 tokens)
    repeat_len: int = setting(50, at_least(2))
    n_sequences: int = setting(50, COUNT)  # smollm2-135m: ~5 min on 2 cores with the ablations
    # Olsson et al.'s in-context learning score (loss of the 500th token minus that of the 50th) on this text
    # cut into consecutive sequences of icl_len tokens (default: the text headlab ships); "" leaves it out
    icl_text: str = "alice.txt"
    icl_len: int = setting(512, at_least(500))  # Olsson et al.'s context length; at least 500 (the 500th token)


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, sc = ctx.cfg, ctx.options
    if option(cfg.model.kind) == "toy" and 1 + 2 * sc.repeat_len > cfg.model.n_ctx:  # before it is trained
        raise UsageError(
            f"study.repeat_len={sc.repeat_len}: BOS and two copies exceed the model's {cfg.model.n_ctx} positions"
        )
    icl_file = text_file(sc.icl_text) if sc.icl_text else None  # a missing file stops the run before any work
    model = ctx.get_model(runs_task=False)  # its own random-token sequences: any model, whatever the task
    text = _icl_sequences(ctx, model, icl_file, sc.icl_len)
    n_total = model.n_layers * model.n_heads
    if not 0 <= sc.top_k <= n_total:
        raise UsageError(f"study.top_k must lie in 0..{n_total} (the heads of {model.name}), not {sc.top_k}")
    # a toy model's own small vocabulary holds fewer distinct tokens than repeat_len (as score_table does)
    seq_len = max(2, min(sc.repeat_len, len(ordinary_ids(model))))
    if seq_len < sc.repeat_len:
        ctx.note(f"{model.name} has {seq_len} ordinary tokens: sequences of {seq_len}, not {sc.repeat_len}")
    model.place(cfg.device)
    info = run_info(cfg)
    with ctx.timed("scores"):
        scores = induction_scores(model, sc.n_sequences, seq_len, seed=cfg.seed)  # [layer, head, n, 4]
    per_head = scores.flatten(0, 1).numpy().astype(np.float64)  # [layer * head, n, 4], layer-major
    induction = per_head[..., SEQ_SCORES.index("induction_score")].mean(1)
    parts = [_score_rows(per_head, model.n_heads, info, cfg.output.n_boot)]
    ctx.meta.update(
        {
            "top_induction_heads": [
                f"{head_name(*divmod(int(i), model.n_heads))} {induction[i]:.3f}"
                for i in np.argsort(-induction, kind="stable")[:TOP_HEADS]
            ],
            "top_k": sc.top_k,
            "repeat_len": seq_len,
            "n_sequences": sc.n_sequences,
            "model_family": model.family,
        }
    )
    if sc.top_k == 0:  # the scores alone (the atlas's probe)
        return results.conform(pd.concat(parts, ignore_index=True))
    top = top_heads(torch.from_numpy(induction), model.n_heads, sc.top_k)
    avoid = avoided_heads(torch.from_numpy(induction), model.n_heads, sc.top_k, sc.random_outside)
    draws, apart = random_heads(model.n_layers, model.n_heads, avoid, sc.top_k, sc.n_random, cfg.seed)
    if not apart:
        ctx.note(f"fewer than {sc.top_k} heads besides the top {len(avoid)}: random draws may include top heads")
    ids = repeated_tokens(model, sc.n_sequences, seq_len, seed=cfg.seed)  # the sequences the scores read
    data = repeat_data(ids, seq_len).to(str(model.input_device))
    with ctx.timed("ablation"):
        losses = ablated_repeat_loss(model, data, [top, *draws], seed=cfg.seed).cpu().numpy().astype(np.float64)
    groups = [f"top{sc.top_k}", *(f"random{sc.top_k}_{d}" for d in range(len(draws)))]
    parts.append(_ablation_rows(losses, groups, info, cfg))
    if text is not None:
        with ctx.timed("icl"):
            sequences = icl_data(text).to(str(model.input_device))
            icl = ablated_icl_score(model, sequences, [top, *draws], seed=cfg.seed).cpu().numpy().astype(np.float64)
        parts.append(_runs(icl, ICL_QUANTITIES, groups, info, cfg.output.n_boot))
        score = icl[..., ICL_QUANTITIES.index("icl_score")].mean(1)
        ctx.meta.update(
            {
                "icl_score_clean": float(score[0]),
                "icl_score_top_k_ablated": float(score[1]),
                "icl_score_random_k_ablated_mean": float(score[2:].mean()) if len(draws) else None,
                "icl_text": str(icl_file),
                "icl_sequences": int(text.shape[0]),
                "icl_len": int(text.shape[1]),
            }
        )
    table = pd.concat(parts, ignore_index=True)
    second = losses[..., REPEAT_QUANTITIES.index("second_copy_loss")].mean(1)  # [1 + groups]
    ctx.meta.update(
        {
            "ablated_top_heads": [head_name(*h) for h in top],
            "ablated_random_heads": [[head_name(*h) for h in heads] for heads in draws],
            "first_copy_loss": float(losses[0, :, 0].mean()),
            "second_copy_loss_clean": float(second[0]),
            "second_copy_loss_top_k_ablated": float(second[1]),
            "second_copy_loss_random_k_ablated": [float(s) for s in second[2:]],
            "second_copy_loss_random_k_ablated_mean": float(second[2:].mean()) if len(draws) else None,
            "n_random": sc.n_random,
            "ablation": "each head's output (z, before W_O) zeroed at every position, the group together",
        }
    )
    return results.conform(table)


def _score_rows(per_head: np.ndarray, n_heads: int, info: dict, n_boot: int) -> pd.DataFrame:
    labels = [
        {
            "intervention": "none",
            "method": "score",
            "layer": layer,
            "head": head,
            "hook": hook_name(Site.pattern, layer),  # SEQ_SCORES are attention weights
        }
        for layer, head in (divmod(i, n_heads) for i in range(per_head.shape[0]))
    ]
    metrics = {name: mean_of(j) for j, name in enumerate(SEQ_SCORES)}
    return results.tidy(info, labels, per_head, SEQ_SCORES, {}, metrics, n_boot=n_boot)


def _icl_sequences(ctx: RunContext, model: HookedModel, file: Path | None, length: int) -> torch.Tensor | None:
    """The text's sequences for the ICL score, or None (with a note) where the model cannot read them."""
    if file is None:
        return None
    config = getattr(getattr(model, "module", None), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if model.tokenizer is None or (isinstance(limit, int) and limit < length):
        why = "has no tokenizer" if model.tokenizer is None else f"has {limit} positions, fewer than {length}"
        ctx.note(f"{model.name} {why}: no in-context learning score on {file.name}")
        return None
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HeadlabError(f"study.icl_text: cannot read {file} as UTF-8 text ({type(e).__name__})") from None
    ids = text_sequences(model.tokenizer, text, length)
    if ids.shape[0] == 0:
        raise HeadlabError(f"study.icl_text: {file.name} holds fewer than {length} tokens (lower study.icl_len)")
    return ids


def _runs(quantities: np.ndarray, names: tuple[str, ...], groups: list[str], info: dict, n_boot: int) -> pd.DataFrame:
    """Rows of the clean run, then of each ablated group, for per-sequence `quantities` [1 + groups, n, Q]."""
    ablated = {"intervention": "ablate_head", "method": "zero"}  # no hook: a group's heads may span layers
    labels = [{"intervention": "none", "method": "none"}, *({**ablated, "group": g} for g in groups)]
    metrics = {name: mean_of(j) for j, name in enumerate(names)}
    return results.tidy(info, labels, quantities, names, {}, metrics, n_boot=n_boot)


def _ablation_rows(losses: np.ndarray, groups: list[str], info: dict, cfg) -> pd.DataFrame:
    """The clean run and each ablated group: the repeat loss, and the second copy's loss increase paired
    over sequences (the same sequences in every run, so the pairing removes their spread)."""
    ablated = {"intervention": "ablate_head", "method": "zero"}
    labels = [{"intervention": "none", "method": "none"}, *({**ablated, "group": g} for g in groups)]
    loss_rows = _runs(losses, REPEAT_QUANTITIES, groups, info, cfg.output.n_boot)
    column = REPEAT_QUANTITIES.index("second_copy_loss")
    increase = (losses[1:, :, column] - losses[:1, :, column])[..., None]
    aggregate = {"second_copy_loss_increase": mean_of(0)}
    rows = results.tidy(info, labels[1:], increase, ["second_copy_loss_increase"], {}, aggregate, cfg.output.n_boot)
    return pd.concat([loss_rows, rows], ignore_index=True)


def summary(df: pd.DataFrame, max_rows: int) -> None:
    """The heads of highest induction score with their other scores, then the repeat loss clean and with
    each group ablated."""
    agg = aggregated(df)
    scores = agg[agg["method"] == "score"]
    if len(scores):
        wide = scores.pivot_table(index=["layer", "head"], columns="metric", values="value", sort=False)
        best = wide.sort_values("induction_score", ascending=False, kind="stable").head(max_rows)
        ci = scores[scores["metric"] == "induction_score"].set_index(["layer", "head"])
        table = Table(title=f"{agg['model'].iloc[0]}: top induction heads ({int(scores['n'].iloc[0])} sequences)")
        columns = [c for c in ("induction_score_tl", "prev_token_score", "duplicate_token_score") if c in wide]
        for col in ("head", "induction_score", "95% interval", *columns):
            table.add_column(col, justify="right")
        for (layer, head), r in best.iterrows():
            low, high = ci.loc[(layer, head), ["ci_low", "ci_high"]]
            table.add_row(
                head_name(int(layer), int(head)),
                f"{r['induction_score']:.3f}",
                f"{low:.3f}..{high:.3f}",
                *(f"{r[c]:.3f}" for c in columns),
            )
        console.print(table)
    runs = agg[agg["method"] != "score"]
    if len(runs):
        runs = runs.assign(group=runs["group"].fillna("clean") if "group" in runs else "clean")
        wide = runs.pivot_table(index="group", columns="metric", values="value", sort=False)
        table = Table(title="repeat loss (nats), heads zero-ablated together")
        metrics = [m for m in (*REPEAT_QUANTITIES, "second_copy_loss_increase") if m in wide]
        for col in ("group", *metrics):
            table.add_column(col, justify="right")
        for group, r in wide.iterrows():
            table.add_row(str(group), *("" if pd.isna(r[m]) else f"{r[m]:.3f}" for m in metrics))
        console.print(table)
        icl = runs[runs["metric"] == "icl_score"].set_index("group")
        if len(icl):
            n = int(icl["n"].iloc[0])
            table = Table(
                title=f"in-context learning score on text (nats; Olsson et al.: about -0.4 after the phase change), "
                f"{n} sequences"
            )
            for col in ("group", "icl_score", "95% interval", "loss_50th_token", "loss_500th_token"):
                table.add_column(col, justify="right")
            for group, r in icl.iterrows():
                table.add_row(
                    str(group),
                    f"{r['value']:.3f}",
                    f"{r['ci_low']:.3f}..{r['ci_high']:.3f}",
                    f"{wide.loc[group, 'loss_50th_token']:.3f}",
                    f"{wide.loc[group, 'loss_500th_token']:.3f}",
                )
            console.print(table)


STUDY = Study(
    name="induction",
    description="induction heads (Olsson et al. 2022): repeated-token scores, ICL score on text, top heads ablated",
    run=run,
    summary=summary,
    reads=("train",),  # a toy model is trained on the task
    figures="scores",
    schema=InductionOptions,
)
