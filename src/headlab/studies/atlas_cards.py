"""The atlas's own probe: attention entropy and distance per head on the text (the model's own task's
prompts where it has no tokenizer), and what each head's card shows besides its scores: its attention
pattern on an example prompt, the tokens it attends to most and the tokens its OV circuit writes most
(analysis/attention_stats.py). Cached like the other probes, under output.root/atlas/<model>/attention-<key>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from .. import results
from ..analysis.attention_stats import ATTENTION_QUANTITIES, attention_profile, example_patterns, logit_lens_top
from ..analysis.scores import repeated_tokens
from ..config import Config, cache_key, run_info, to_plain
from ..io import atomic_write_bytes
from ..models.hooked import HookedModel
from ..tables import head_name
from ..tasks import TaskData, build_task, mean_of
from ..vocabulary import Site, hook_name
from .atlas_probes import ROW_COLUMNS, AtlasOptions, cache_dir, probe_config, text_overrides
from .context import RunContext

CARDS = "cards.json"
TOP_TOKENS = 8  # tokens listed per head: attended to, written
EXAMPLE_TOKENS = 12  # the example prompt: this many tokens of the text, then the same again
SCORE_NAMES = {"attention_entropy": "entropy", "attention_distance": "distance"}


def _token(model: HookedModel, token_id: int) -> str:
    tok = model.tokenizer
    return tok.decode([token_id]) if tok is not None else str(token_id)


@dataclass
class CardCache:
    """Where a card probe (attention's, attribution's) is cached and how it draws its prompts."""

    cfg: Config  # the probe's config: the text's documents where the model has a tokenizer, else its task
    key: str
    where: Path
    cached: bool
    context: RunContext  # draws the probe's prompts on the atlas's loaded model
    text: bool  # the prompts are the text's (the model has a tokenizer)

    def first_document(self, data: TaskData) -> torch.Tensor | None:
        """The first prompt's real tokens, where the prompts are the text's (the example prompt's source)."""
        if not self.text:
            return None
        first, real = data.inputs["input_ids"][0], data.inputs.get("attention_mask")
        return (first if real is None else first[real[0].bool()]).cpu()


def card_cache(
    ctx: RunContext, model: HookedModel, options: AtlasOptions, name: str, version: int | None, marker: str | None
) -> CardCache:
    """The set-up both card probes share: their config, their cache key (the model, training, task and seed,
    and the probe's `version` of what its cards hold), the folder output.root/atlas/<model>/<name>-<key>,
    whether it holds a complete result (`marker`, a file the probe writes last; None: results.is_complete)."""
    text = model.tokenizer is not None
    cfg = probe_config(ctx.cfg, text_overrides(options, 0) if text else [])
    plain = to_plain(cfg)
    parts = {k: plain[k] for k in ("model", "train", "task", "seed")}
    key = cache_key(parts if version is None else {**parts, "probe": f"{name}-{version}"})
    where = cache_dir(ctx.cfg, name, key)
    cached = (where / marker).is_file() if marker else results.is_complete(where)
    ctx.meta.setdefault("probes", {})[name] = {"dir": str(where), "cached": cached}
    return CardCache(cfg, key, where, cached, RunContext(cfg, where, task=build_task(cfg.task), model=model), text)


def example_prompt(model: HookedModel, first_document: torch.Tensor | None, seed: int) -> torch.Tensor:
    """A short stretch of the text repeated once (natural text, and a repeat for previous-token, duplicate
    and induction heads to show); random ordinary tokens repeated for a model without tokenizer."""
    if first_document is None:
        return repeated_tokens(model, 1, EXAMPLE_TOKENS // 2, seed)[0]
    part = first_document[:EXAMPLE_TOKENS]
    return torch.cat([part, part])


def cards_of(
    model: HookedModel, data: TaskData, first_document: torch.Tensor | None, seed: int
) -> tuple[np.ndarray, dict]:
    """Per-prompt ATTENTION_QUANTITIES [heads, prompts, 2] and the cards' JSON."""
    profile = attention_profile(model, data)
    ids = example_prompt(model, first_document, seed)
    patterns = example_patterns(model, ids)  # [heads, pos, pos]
    values, written = logit_lens_top(model, profile.output.float(), TOP_TOKENS)
    share = profile.received / profile.received.sum(-1, keepdim=True).clamp(min=1e-30)
    top_share, columns = share.topk(min(TOP_TOKENS, share.shape[-1]), dim=-1)
    attended = profile.tokens[columns]  # [heads, k] token ids
    heads = model.n_layers * model.n_heads
    names = [head_name(*divmod(i, model.n_heads)) for i in range(heads)]
    cards = {
        "tokens": [_token(model, int(t)) for t in ids],
        "patterns": {n: (patterns[i] * 1000).round().int().tolist() for i, n in enumerate(names)},  # per mille
        "attends": {
            n: [[_token(model, int(t)), round(float(s), 4)] for t, s in zip(attended[i], top_share[i])]
            for i, n in enumerate(names)
        },
        "writes": {
            n: [[_token(model, int(t)), round(float(v), 3)] for t, v in zip(written[i], values[i])]
            for i, n in enumerate(names)
        },
    }
    return profile.quantities.numpy().astype(np.float64), cards


def attention_probe(
    ctx: RunContext, model: HookedModel, options: AtlasOptions, wanted: set[str]
) -> tuple[pd.DataFrame, dict]:
    """The wanted ATTENTION_QUANTITIES' atlas rows and the cards, from the cache where they were computed."""
    cache = card_cache(ctx, model, options, "attention", None, None)
    cfg, where = cache.cfg, cache.where
    if cache.cached:
        table = results.conform(pd.read_parquet(Path(where) / results.TABLE))  # one cached before the hook column
        cards = json.loads((Path(where) / CARDS).read_text())
    else:
        inner = cache.context
        data = inner.get_data()
        quantities, cards = cards_of(model, data, cache.first_document(data), cfg.seed)
        labels = [
            {
                "intervention": "none",
                "method": "score",
                "layer": layer,
                "head": head,
                "hook": hook_name(Site.pattern, layer),  # entropy and distance of the head's pattern
            }
            for layer in range(model.n_layers)
            for head in range(model.n_heads)
        ]
        metrics = {name: mean_of(j) for j, name in enumerate(ATTENTION_QUANTITIES)}
        info = run_info(cfg)
        table = results.tidy(info, labels, quantities, ATTENTION_QUANTITIES, {}, metrics, n_boot=cfg.output.n_boot)
        Path(where).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(where) / CARDS, json.dumps(cards).encode())  # before meta.json marks it complete
        results.write(table, where, results.run_meta(cache.key, inner.timings, {"study": "atlas attention"}))
    keep = [name for name, score in SCORE_NAMES.items() if score in wanted]
    rows = table.loc[table["metric"].isin(keep), ROW_COLUMNS].assign(probe="attention", probe_task=cfg.task.name)
    return rows, cards
