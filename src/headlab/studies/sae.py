"""`headlab sae`: fit (or reuse) an SAE on one layer's z, measure it, attribute its features to heads,
export it for SAELens, and write the run's tables.

<run>/results.parquet (+ csv)   tidy: the SAE's metrics (intervention "sae", method = architecture), the
                                training curve (method "fit", column step), per head its polysemanticity
                                numbers (attribution.head_polysemanticity; contexts classed by the
                                task's roles, `task.context_classes`, else by token type), per
                                feature and head the decoder share (column feature), and
                                direct feature attribution per head and source position (metric dfa)
                                for the top context of the most frequent features, and per live feature
                                its top-activating contexts (metric top_context, columns rank, token,
                                context: the activating token in [[ ]] after its preceding tokens,
                                context_class)
<run>/contexts.parquet (+ csv)  the same contexts alone, for eyes and spreadsheets
<run>/sae/                      cfg.json + sae_weights.safetensors (SAELens: SAE.load_from_disk)
The fitted SAE itself lives in <output.root>/saes/<model>-L<layer>-<architecture>-<hash>/ and is reused
by every run with the same model, task, corpus and SAE settings.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from rich.table import Table

from .. import results
from ..config import Config, config_hash, option, run_info, to_plain
from ..errors import UsageError
from ..io import atomic_write_bytes, held_exclusively
from ..models.hooked import HookedModel
from ..sae import build_sae
from ..sae.activations import Corpus, corpus_z, real_tokens, stream, task_corpus, text_corpus
from ..sae.attribution import decoder_head_shares, direct_feature_attribution, head_polysemanticity, top_activations
from ..sae.export import CFG, WEIGHTS, hook_name, load_sae, save_sae
from ..sae.fit import fit
from ..sae.metrics import ce_recovered, reconstruction_metrics
from ..tasks import Task
from .context import RunContext
from .study import Study
from .summary import aggregated, console

DONE = "headlab.json"
EVAL_SEED = 77_777  # held-out prompts: apart from the training stream's passes
HELD_OUT = 10  # a text corpus keeps its last 1/10 of windows out of training
DFA_FEATURES = 8  # features whose top context is split by head and source position
# settings that do not change the fitted SAE (evaluation and display only)
DISPLAY_KEYS = ("eval_sequences", "top_contexts", "context_window", "dominance")
HEAD_METRICS = (
    "n_dominated",
    "effective_features",
    "multi_feature",
    "n_context_classes",
    "min_class_overlap",
    "polysemantic",
)


def sae_dir(cfg: Config) -> Path:
    plain = to_plain(cfg)
    plain["task"] = {k: v for k, v in plain["task"].items() if k not in ("n_reference",)}
    plain["sae"] = {k: v for k, v in plain["sae"].items() if k not in DISPLAY_KEYS}
    digest = config_hash(plain, ("model", "task", "train", "seed", "sae"))
    name = f"{cfg.model.name}-L{cfg.sae.layer}-{option(cfg.sae.architecture)}-{digest}"
    return Path(cfg.output.root) / "saes" / name


def corpora(cfg: Config, task: Task, model: HookedModel):
    """(passes: i -> the corpus of training pass i, held-out corpus)."""
    sc = cfg.sae
    if sc.corpus:
        corpus = text_corpus(sc.corpus, model, sc.context_size)
        n = corpus.ids.shape[0]
        split = n - max(1, n // HELD_OUT)  # fixed: no evaluation setting changes what the SAE trains on
        train = corpus.rows(torch.arange(0, split))
        return (lambda _i: train), corpus.rows(torch.arange(split, min(n, split + sc.eval_sequences)))
    n = max(cfg.task.n_prompts, sc.model_batch)
    return (lambda i: task_corpus(task, model, n, seed=cfg.seed * 1_000_003 + i)), task_corpus(
        task, model, sc.eval_sequences, seed=EVAL_SEED + cfg.seed
    )


def obtain_sae(cfg: Config, model: HookedModel, passes, show_progress: bool):
    """The fitted SAE of this config and its fit record: fitted now, resumed, or reused."""
    with held_exclusively(sae_dir(cfg)):
        return _fitted_sae(cfg, model, passes, show_progress)


def _fitted_sae(cfg: Config, model: HookedModel, passes, show_progress: bool):
    sc, directory = cfg.sae, sae_dir(cfg)
    if (directory / DONE).is_file():
        sae, _ = load_sae(directory)
        return sae, json.loads((directory / DONE).read_text())
    d_in = model.sites.n_heads * model.sites.d_head
    sae = build_sae(sc, d_in, seed=cfg.seed)
    # a resumed fit streams passes it has not seen: pass numbers (prompt seeds) start from the step
    batches = lambda step: stream(
        model,
        sc.layer,
        lambda i: passes(step * 1_000 + i),
        sc.batch_size,  # noqa: E731
        sc.buffer_tokens,
        sc.model_batch,
        seed=cfg.seed * 1_000_003 + step,
    )
    record = fit(sae, batches, sc, directory, show_progress, label=f"sae {option(sc.architecture)} L{sc.layer}")
    meta = {
        "model_name": cfg.model.name,
        "hook_name": hook_name(sc.layer),
        "context_size": sc.context_size,
        "dataset_path": sc.corpus or f"task:{cfg.task.name}",
        "n_heads": model.sites.n_heads,
        "d_head": model.sites.d_head,
        "l1_coeff": sc.l1_coeff,
    }
    save_sae(sae, directory, meta)
    atomic_write_bytes(directory / DONE, json.dumps({"complete": True, **record}).encode())  # last
    return sae.eval(), record


def token_text(model: HookedModel, task: Task) -> Callable[[Any], str]:
    if model.tokenizer is not None:
        return lambda i: model.tokenizer.decode([int(i)])
    strings = getattr(task, "token_strings", None)
    if strings:
        return lambda i: strings[int(i)] + " "
    names = getattr(task, "token_names", None) or {}
    return lambda i: names.get(int(i), str(int(i))) + " "


def token_type(text: str) -> str:
    """A coarse class of a token's text, for corpora whose task names no roles."""
    bare = text.strip()
    if not bare:
        return "space"
    if bare.isdigit():
        return "number"
    if bare.isalpha():
        return "word" if text[0].isspace() else "word piece"
    if all(not c.isalnum() for c in bare):
        return "punctuation"
    return "other"


def context_classes(task: Task, corpus: Corpus, text: Callable[[Any], str]) -> tuple[torch.Tensor, tuple[str, ...]]:
    """([n, pos] class index of every corpus position, class names): the task's roles where it defines
    them, else the type of the token at the position."""
    own = getattr(task, "context_classes", None)
    found = own(corpus.ids) if own is not None else None
    if found is not None:
        return found
    tokens, inverse = corpus.ids.unique(return_inverse=True)
    types = [token_type(text(t)) for t in tokens.tolist()]
    names = tuple(sorted(set(types)))
    index = torch.tensor([names.index(t) for t in types])
    return index[inverse], names


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, show_progress = ctx.cfg, ctx.show_progress
    if option(cfg.model.kind) == "pathnet":
        raise UsageError("model=pathnet has no token inputs to fit an SAE on")
    with ctx.timed("load"):
        task, model = ctx.get_task(), ctx.get_model()
    sc = cfg.sae
    if not 0 <= sc.layer < model.n_layers:
        raise UsageError(f"sae.layer={sc.layer}: model {cfg.model.name} has layers 0..{model.n_layers - 1}")
    start = time.perf_counter()
    passes, held_out = corpora(cfg, task, model)
    ctx.timings["load"] += time.perf_counter() - start
    with ctx.timed("fit"):
        sae, record = obtain_sae(cfg, model, passes, show_progress)
    start = time.perf_counter()
    x = corpus_z(model, sc.layer, held_out, sc.model_batch)
    metrics = reconstruction_metrics(sae, x)
    metrics.update(ce_recovered(model, sc.layer, held_out, lambda z: sae(z)[0], sc.model_batch))
    metrics["dead_window_fraction"] = record["dead_window_fraction"]
    n_heads = model.sites.n_heads
    shares = decoder_head_shares(sae, n_heads)
    values, where, frequency = top_activations(sae, x, sc.top_contexts)
    locate = real_tokens(held_out).nonzero()  # token index -> (row, position)
    text = token_text(model, task)
    grid, class_names = context_classes(task, held_out, text)
    row_pos = locate[where]  # [k, d_sae, 2]
    classes = grid[row_pos[..., 0], row_pos[..., 1]].masked_fill(values <= 0, -1)
    heads = head_polysemanticity(shares, frequency, sc.dominance, classes)
    metrics["polysemantic_head_fraction"] = sum(h["polysemantic"] for h in heads) / n_heads
    metrics["multi_feature_head_fraction"] = sum(h["multi_feature"] for h in heads) / n_heads
    ctx.timings["evaluate"] = time.perf_counter() - start
    info = {**run_info(cfg), "intervention": "sae", "method": option(sc.architecture), "layer": sc.layer}
    tokens = int(x.shape[0])
    rows = [{**info, "metric": k, "value": v, "n": tokens} for k, v in metrics.items()]
    rows += [
        {**info, "method": "fit", "metric": p["metric"], "value": p["value"], "n": sc.batch_size, "step": p["step"]}
        for p in record["curve"]
    ]
    for h in heads:
        rows += [{**info, "head": h["head"], "metric": k, "value": float(h[k]), "n": tokens} for k in HEAD_METRICS]
    live = (frequency > 0).nonzero().squeeze(1)
    share_rows = pd.DataFrame(
        {
            "feature": live.repeat_interleave(n_heads).numpy(),
            "head": torch.arange(n_heads).repeat(len(live)).numpy(),
            "value": shares[live].reshape(-1).numpy(),
        }
    )
    share_rows = share_rows.assign(**info, metric="decoder_share", n=tokens)
    contexts = contexts_table(held_out, locate, values, where, live, text, sc.context_window)
    ranks = torch.tensor(contexts["rank"].tolist(), dtype=torch.long)
    features = torch.tensor(contexts["feature"].tolist(), dtype=torch.long)
    contexts["context_class"] = [class_names[c] for c in classes[ranks, features].tolist()]
    dfa = dfa_rows(model, sc.layer, sae, held_out, locate, values, where, frequency, info)
    context_rows = contexts.rename(columns={"activation": "value"}).assign(**info, metric="top_context", n=1)
    df = results.conform(pd.concat([pd.DataFrame(rows), share_rows, dfa, context_rows], ignore_index=True))
    ctx.meta.update({"sae_dir": str(sae_dir(cfg)), "fit_seconds": record["seconds"], "fit_tokens": record["tokens"]})
    if ctx.run_dir is not None:
        export = Path(ctx.run_dir) / "sae"
        export.mkdir(parents=True, exist_ok=True)
        for name in (WEIGHTS, CFG):
            shutil.copyfile(sae_dir(cfg) / name, export / name)
        atomic_write_bytes(Path(ctx.run_dir) / "contexts.parquet", contexts.to_parquet(index=False))
        atomic_write_bytes(Path(ctx.run_dir) / "contexts.csv", contexts.to_csv(index=False).encode())
    return df


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
    """The SAE's metrics, then per head how many features it dominates and how polysemantic they are."""
    df = aggregated(df)
    top = df[(df["intervention"] == "sae") & (df["method"] != "fit") & df["head"].isna()]
    if top.empty:
        return
    arch, layer = top["method"].iloc[0], int(top["layer"].iloc[0])
    table = Table(
        title=f"{df['model'].iloc[0]}: {arch} SAE on blocks.{layer}.attn.hook_z "
        f"({int(top['n'].iloc[0])} held-out tokens)"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for _, r in top.iterrows():
        table.add_row(str(r["metric"]), f"{r['value']:.4f}")
    console.print(table)
    columns = ("n_dominated", "effective_features", "n_context_classes", "min_class_overlap", "polysemantic")
    heads = df[(df["intervention"] == "sae") & df["metric"].isin(columns) & df["head"].notna()]
    wide = heads.pivot(index="head", columns="metric", values="value").reset_index()  # keeps nan overlaps
    table = Table(title="features per head (decoder-norm dominance; polysemantic: two with unrelated contexts)")
    for col in ("head", *columns):
        table.add_column(col, justify="right")
    for _, r in wide.head(max_rows).iterrows():
        table.add_row(
            str(int(r["head"])),
            str(int(r["n_dominated"])),
            f"{r['effective_features']:.2f}",
            str(int(r["n_context_classes"])),
            f"{r['min_class_overlap']:.2f}",
            "yes" if r["polysemantic"] else "no",
        )
    console.print(table)


STUDY = Study(
    name="sae",
    description="`headlab sae`: an SAE on one layer's head outputs z; its metrics and features per head",
    run=run,
    summary=summary,
    reads=("model", "task", "train", "sae"),
    sections=("sae",),
)
