"""`headlab sae`: fit (or reuse) an SAE on the z of one layer (sae.layer) or of each of several
(sae.layers), measure it, attribute its features to heads, export it for SAELens, and write the run's
tables (one set of rows per layer, column layer).

Corpus: sae.corpus, else the task's prompts; a pretrained model on a task with a vocabulary of its own
(the default task=counting on model=smollm2-135m) has no prompts of that task to read, so it reads the
text that ships with headlab (data/alice.txt, locations.text_path).

<run>/results.parquet (+ csv)   tidy: the SAE's metrics (intervention "sae", method = architecture), the
                                training curve (method "fit", column step), per head its roles and
                                polysemanticity (sae/head_attribution.py's head_roles: its top
                                sae.head_features features by decoder share, Kissane et al.'s reading;
                                metric top_features_in_role per head and column context_class: how many
                                of them have each role; and the old rule, head_polysemanticity, its
                                metrics named *_dominated; contexts classed by their place in the text
                                for a text corpus, sae/contexts.py, else by the task's roles,
                                `task.context_classes`, else by token type), per feature and head the
                                decoder share (column feature), and
                                direct feature attribution per head and source position (metric dfa)
                                for the top context of the most frequent features, and per live feature
                                its top-activating contexts (metric top_context, columns rank, token,
                                context: the activating token in [[ ]] after its preceding tokens,
                                context_class)
<run>/contexts.parquet (+ csv)  the same contexts alone, for eyes and spreadsheets
<run>/sae/                      cfg.json + sae_weights.safetensors (SAELens: SAE.load_from_disk);
                                with several layers one folder per layer, <run>/sae/L<layer>/
The fitted SAE itself lives in <output.root>/saes/<model>-L<layer>-<architecture>-<hash>/ and is reused
by every run with the same model, task, corpus and SAE settings.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pandas as pd
import torch

from .. import results
from ..config import Config, cache_key, option, run_info, to_plain
from ..errors import UsageError
from ..io import atomic_write_bytes, held_exclusively
from ..locations import text_path
from ..models.hooked import HookedModel
from ..sae import build_sae
from ..sae.activations import Corpus, corpus_z, real_tokens, stream, task_corpus, text_corpus
from ..sae.export import CFG, WEIGHTS, hook_name, load_sae, save_sae
from ..sae.fit import fit
from ..sae.head_attribution import (
    decoder_head_shares,
    head_polysemanticity,
    head_roles,
    random_polysemantic_fraction,
    top_activations,
)
from ..sae.metrics import ce_recovered, cross_entropy, reconstruction_metrics
from ..sae.source_roles import SOURCE_ROLES, source_role_grid
from ..tasks import Task
from .context import RunContext
from .sae_tables import context_classes, contexts_table, dfa_rows, summary, token_text
from .study import Study

DONE = "headlab.json"
SCALE = "input_scale.json"  # sae.normalize: the factor z is fitted at
EVAL_SEED = 77_777  # held-out prompts: apart from the training stream's passes
HELD_OUT = 10  # a text corpus keeps its last 1/10 of windows out of training
# settings that do not change the fitted SAE (evaluation and display only)
DISPLAY_KEYS = ("eval_sequences", "top_contexts", "context_window", "head_features", "dominance")
ROLE_METRICS = (  # head_roles: Kissane et al.'s reading
    "n_top_features",
    "top_feature_share",
    "n_roles",
    "largest_role_share",
    "min_class_overlap",
    "polysemantic",
)
NULL_DRAWS = 1000  # random feature sets behind polysemantic_random_fraction
DOMINATED_METRICS = (  # head_polysemanticity: the old rule
    "n_dominated",
    "effective_features",
    "multi_feature",
    "n_context_classes_dominated",
    "min_class_overlap_dominated",
    "polysemantic_dominated",
)


def sae_dir(cfg: Config) -> Path:
    plain = to_plain(cfg)
    plain["task"] = {k: v for k, v in plain["task"].items() if k not in ("n_reference",)}
    plain["sae"] = {k: v for k, v in plain["sae"].items() if k not in DISPLAY_KEYS}
    digest = cache_key({k: plain[k] for k in ("model", "task", "train", "seed", "sae")})
    name = f"{cfg.model.name}-L{cfg.sae.layer}-{option(cfg.sae.architecture)}-{digest}"
    return Path(cfg.output.root) / "saes" / name


def corpus_path(cfg: Config, task: Task) -> str | None:
    """The text the SAE reads (None: the task's prompts): sae.corpus, else for a pretrained model on a
    task with its own vocabulary (whose prompts it cannot read) the text that ships with headlab."""
    if cfg.sae.corpus:
        return cfg.sae.corpus
    own_vocabulary = not task.needs_tokenizer and task.vocab_size > 0
    if option(cfg.model.kind) == "hf" and own_vocabulary:
        return str(text_path("data/alice.txt"))
    return None


def corpora(cfg: Config, task: Task, model: HookedModel):
    """(passes: i -> the corpus of training pass i, held-out corpus)."""
    sc = cfg.sae
    path = corpus_path(cfg, task)
    if path:
        corpus = text_corpus(path, model, sc.context_size)
        n = corpus.ids.shape[0]
        split = n - max(1, n // HELD_OUT)  # fixed: no evaluation setting changes what the SAE trains on
        train = corpus.rows(torch.arange(0, split))
        return (lambda _i: train), corpus.rows(torch.arange(split, min(n, split + sc.eval_sequences)))
    n = max(cfg.task.n_prompts, sc.model_batch)
    return (lambda i: task_corpus(task, model, n, seed=cfg.seed * 1_000_003 + i)), task_corpus(
        task, model, sc.eval_sequences, seed=EVAL_SEED + cfg.seed
    )


def obtain_sae(cfg: Config, model: HookedModel, passes, show_progress: bool, dataset: str = ""):
    """The fitted SAE of this config and its fit record: fitted now, resumed, or reused."""
    with held_exclusively(sae_dir(cfg)):
        return _fitted_sae(cfg, model, passes, show_progress, dataset)


def _fitted_sae(cfg: Config, model: HookedModel, passes, show_progress: bool, dataset: str):
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
    scale = 1.0
    if sc.normalize:  # measured once, before the first step, and kept: a resumed fit draws no pass twice
        kept = directory / SCALE
        if not kept.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(kept, json.dumps(input_scale(model, sc.layer, passes(0), sc.model_batch)).encode())
        scale = float(json.loads(kept.read_text()))
    scaled = lambda step: (x * scale for x in batches(step))  # noqa: E731
    record = fit(sae, scaled, sc, directory, show_progress, label=f"sae {option(sc.architecture)} L{sc.layer}")
    sae.fold_input_scale(scale)
    record["input_scale"] = scale
    save_sae(sae, directory, export_meta(cfg, model, dataset))
    atomic_write_bytes(directory / DONE, json.dumps({"complete": True, **record}).encode())  # last
    return sae.eval(), record


def export_meta(cfg: Config, model: HookedModel, dataset: str = "") -> dict:
    """The metadata saved beside the SAE's weights (SAELens's cfg.json); l1_coeff only where the
    architecture has one (topk has none)."""
    sc = cfg.sae
    meta = {
        "model_name": cfg.model.name,
        "hook_name": hook_name(sc.layer),
        "context_size": sc.context_size,
        "dataset_path": dataset or sc.corpus or f"task:{cfg.task.name}",
        "n_heads": model.sites.n_heads,
        "d_head": model.sites.d_head,
    }
    if hasattr(sc, "l1_coeff"):
        meta["l1_coeff"] = sc.l1_coeff
    return meta


def input_scale(model: HookedModel, layer: int, corpus: Corpus, model_batch: int) -> float:
    """sqrt(d_in / mean ||z||^2) over the first model_batch sequences of the first pass."""
    first = corpus.rows(torch.arange(min(model_batch, corpus.ids.shape[0])))
    z = corpus_z(model, layer, first, model_batch)
    return float((z.shape[1] / z.pow(2).sum(1).mean().clamp_min(1e-12)).sqrt())


def fitted_layers(cfg: Config, n_layers: int) -> list[int]:
    """sae.layers (in order, once each; a negative one counts from the last, as Python's indices do), else
    sae.layer; a layer the model lacks is refused."""
    sc = cfg.sae
    named = list(sc.layers) if sc.layers else [sc.layer]
    for layer in named:
        if not -n_layers <= layer < n_layers:
            name = "sae.layers" if sc.layers else "sae.layer"
            raise UsageError(f"{name}={layer}: model {cfg.model.name} has layers 0..{n_layers - 1}")
    return list(dict.fromkeys(layer % n_layers for layer in named))


def at_layer(cfg: Config, layer: int) -> Config:
    """The config of one layer's SAE: its directory (sae_dir) is that of a run with sae.layer=layer."""
    return dataclasses.replace(cfg, sae=dataclasses.replace(cfg.sae, layer=layer, layers=None))


def run(ctx: RunContext) -> pd.DataFrame:
    cfg, show_progress = ctx.cfg, ctx.show_progress
    if option(cfg.model.kind) == "pathnet":
        raise UsageError("model=pathnet has no token inputs to fit an SAE on")
    with ctx.timed("load"):
        task = ctx.get_task()
        path = corpus_path(cfg, task)
        model = ctx.get_model(runs_task=path is None)  # a text corpus: the task's prompts are not read
    sc = cfg.sae
    layers = fitted_layers(cfg, model.n_layers)
    start = time.perf_counter()
    passes, held_out = corpora(cfg, task, model)
    text = token_text(model, task)
    grid, class_names = context_classes(task, held_out, text, is_text=path is not None)
    ctx.timings["load"] += time.perf_counter() - start
    ctx.timings.update(fit=0.0, evaluate=0.0)
    start = time.perf_counter()
    clean = cross_entropy(model, layers[0], held_out, None, sc.model_batch)  # one clean pass for every layer
    ctx.timings["evaluate"] += time.perf_counter() - start
    frames, context_frames, fitted = [], [], {}
    for layer in layers:
        lcfg = at_layer(cfg, layer)
        start = time.perf_counter()
        sae, record = obtain_sae(lcfg, model, passes, show_progress, dataset=path or "")
        ctx.timings["fit"] += time.perf_counter() - start
        start = time.perf_counter()
        rows, contexts = layer_rows(lcfg, model, task, sae, record, held_out, clean, grid, class_names)
        ctx.timings["evaluate"] += time.perf_counter() - start
        frames.append(rows)
        context_frames.append(contexts)
        fitted[layer] = (sae_dir(lcfg), record)
    df = results.conform(pd.concat(frames, ignore_index=True))
    contexts = pd.concat(context_frames, ignore_index=True)
    ctx.meta.update(
        {
            "sae_dir": str(fitted[layers[0]][0]) if len(layers) == 1 else {k: str(d) for k, (d, _) in fitted.items()},
            "corpus": path or f"task:{cfg.task.name}",
            "fit_seconds": sum(r["seconds"] for _, r in fitted.values()),
            "fit_tokens": sum(r["tokens"] for _, r in fitted.values()),
        }
    )
    if ctx.run_dir is not None:
        for layer, (directory, _) in fitted.items():
            export = Path(ctx.run_dir) / "sae" / ("" if len(layers) == 1 else f"L{layer}")
            export.mkdir(parents=True, exist_ok=True)
            for name in (WEIGHTS, CFG):
                shutil.copyfile(directory / name, export / name)
        atomic_write_bytes(Path(ctx.run_dir) / "contexts.parquet", contexts.to_parquet(index=False))
        atomic_write_bytes(Path(ctx.run_dir) / "contexts.csv", contexts.to_csv(index=False).encode())
    return df


def layer_rows(cfg: Config, model, task, sae, record, held_out: Corpus, clean: float, grid, class_names):
    """(the tidy rows of one layer's SAE, its top-activating contexts)."""
    sc, layer = cfg.sae, cfg.sae.layer
    x = corpus_z(model, layer, held_out, sc.model_batch)
    metrics = reconstruction_metrics(sae, x)
    metrics.update(ce_recovered(model, layer, held_out, lambda z: sae(z)[0], sc.model_batch, clean=clean))
    metrics["dead_window_fraction"] = record["dead_window_fraction"]
    metrics["fit_seconds"] = record["seconds"]
    n_heads = model.sites.n_heads
    shares = decoder_head_shares(sae, n_heads)
    values, where, frequency = top_activations(sae, x, sc.top_contexts)
    locate = real_tokens(held_out).nonzero()  # token index -> (row, position)
    row_pos = locate[where]  # [k, d_sae, 2]
    classes = grid[row_pos[..., 0], row_pos[..., 1]].masked_fill(values <= 0, -1)
    # a feature's role: where its attention comes from (Kissane et al.'s reading, sae/source_roles.py)
    sources = source_role_grid(model, layer, sae, held_out, locate, values, where, sc.model_batch)
    roles = head_roles(shares, frequency, sources, sc.head_features)
    dominated = head_polysemanticity(shares, frequency, sc.dominance, classes)
    metrics["polysemantic_head_fraction"] = sum(h["polysemantic"] for h in roles) / n_heads
    # the same rule on features assigned to heads at random: how often it fires by itself
    metrics["polysemantic_random_fraction"] = random_polysemantic_fraction(
        frequency, sources, sc.head_features, NULL_DRAWS, cfg.seed
    )
    # the same rule on the classes of the text around the features' contexts (what the text is, not what
    # the attention does)
    by_text = head_roles(shares, frequency, classes, sc.head_features)
    metrics["context_class_polysemantic_head_fraction"] = sum(h["polysemantic"] for h in by_text) / n_heads
    metrics["context_class_polysemantic_random_fraction"] = random_polysemantic_fraction(
        frequency, classes, sc.head_features, NULL_DRAWS, cfg.seed
    )
    metrics["polysemantic_dominated_head_fraction"] = sum(h["polysemantic_dominated"] for h in dominated) / n_heads
    metrics["multi_feature_head_fraction"] = sum(h["multi_feature"] for h in dominated) / n_heads
    info = {
        **run_info(cfg),
        "intervention": "sae",
        "method": option(sc.architecture),
        "layer": layer,
        "hook": hook_name(layer),  # the SAE's input, by the name SAELens attaches it at
    }
    tokens = int(x.shape[0])
    rows = [{**info, "metric": k, "value": v, "n": tokens} for k, v in metrics.items()]
    rows += [
        {**info, "method": "fit", "metric": p["metric"], "value": p["value"], "n": sc.batch_size, "step": p["step"]}
        for p in record["curve"]
    ]
    for r, d in zip(roles, dominated):
        rows += [{**info, "head": r["head"], "metric": k, "value": float(r[k]), "n": tokens} for k in ROLE_METRICS]
        rows += [{**info, "head": d["head"], "metric": k, "value": float(d[k]), "n": tokens} for k in DOMINATED_METRICS]
        counts = r["roles"] + [0] * (len(SOURCE_ROLES) - len(r["roles"]))
        rows += [
            {
                **info,
                "head": r["head"],
                "metric": "top_features_in_role",
                "value": float(c),
                "n": tokens,
                "source_role": name,
            }
            for name, c in zip(SOURCE_ROLES, counts)
        ]
    live = (frequency > 0).nonzero().squeeze(1)
    share_rows = pd.DataFrame(
        {
            "feature": live.repeat_interleave(n_heads).numpy(),
            "head": torch.arange(n_heads).repeat(len(live)).numpy(),
            "value": shares[live].reshape(-1).numpy(),
        }
    )
    share_rows = share_rows.assign(**info, metric="decoder_share", n=tokens)
    text = token_text(model, task)
    contexts = contexts_table(held_out, locate, values, where, live, text, sc.context_window)
    ranks = torch.tensor(contexts["rank"].tolist(), dtype=torch.long)
    features = torch.tensor(contexts["feature"].tolist(), dtype=torch.long)
    contexts["context_class"] = [class_names[c] for c in classes[ranks, features].tolist()]
    contexts["source_role"] = [SOURCE_ROLES[c] if c >= 0 else "" for c in sources[ranks, features].tolist()]
    dfa = dfa_rows(model, layer, sae, held_out, locate, values, where, frequency, info)
    context_rows = contexts.rename(columns={"activation": "value"}).assign(**info, metric="top_context", n=1)
    frame = pd.concat([pd.DataFrame(rows), share_rows, dfa, context_rows], ignore_index=True)
    return frame, contexts.assign(layer=layer)


STUDY = Study(
    name="sae",
    description="`headlab sae`: an SAE on one layer's head outputs z; its metrics and features per head",
    run=run,
    summary=summary,
    reads=("model", "task", "train", "sae"),
    sections=("sae",),
)
