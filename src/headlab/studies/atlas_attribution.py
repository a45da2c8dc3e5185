"""The atlas's attribution cards (a probe of the atlas's own, beside atlas_cards.py's attention probe): each
head's typical edge on the example prompt split over the components building its query and its key, exact at
the clean run's norm scales (analysis/qk_attribution.py, the computation study=head_attribution runs), what
its output there writes and which components wrote it (analysis/ov_attribution.py), and MAPS's weights-only
mappings. Cached under output.root/atlas/<model>/attribution-<key> (atlas_cards.card_cache).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from ..analysis import ov_attribution as ov
from ..analysis import qk_attribution as qk
from ..errors import UsageError
from ..io import atomic_write_bytes
from ..models.hooked import HookedModel
from ..models.norms import held_norm
from ..tables import head_name
from .atlas_cards import card_cache, example_prompt
from .atlas_probes import AtlasOptions
from .context import RunContext

ATTRIBUTION = "attribution.json"
# what the cards hold, in the probe's cache key: moves when a card's computation or content changes
VERSION = 3
CARD_TOP = 5  # components listed per side, pairs and tokens per card
ATLAS_MAPS = 3  # MAPS's salient tokens per head on a card, and targets per token


def typical_edge(pattern: torch.Tensor, special: torch.Tensor | None = None) -> tuple[int, int, float]:
    """(query, key, weight): a head's strongest edge on the example prompt [T, T], its query in the second half
    (the repeat, where previous-token, duplicate and induction heads show), its key after the first token and on
    no special token (`special` [T], True there: a BOS the repeat holds again), where most heads rest (Gu et al.'s
    sink); the first token where the query sees no other."""
    length = pattern.shape[-1]
    start = max(1, length // 2)
    masked = pattern[start:].clone()
    masked[:, 0] = 0
    if special is not None:
        masked[:, special.to(masked.device)] = 0
    best = int(masked.flatten().argmax())
    query, key = divmod(best, length)
    return start + query, key, float(pattern[start + query, key])


def card_of(
    comps: qk.Components,
    parts: qk.LayerParts,
    layer: int,
    head: int,
    word: Callable[[int], str],
    special: torch.Tensor | None = None,
) -> dict:
    """One head's card: its typical edge split over the components on each side (exact at the clean run's norm
    scales), and what its output there writes (through the final norm held at its clean scale) and which
    components wrote it. On a model whose norms move (qk.norms_move) also `removal`: [the query side's largest
    component, the score's drop with it taken out and the scales held (its split total), the drop with them
    free, the input norm's scale change, QK-norm's largest (None: none)]."""
    model = comps.model
    query, key, weight = typical_edge(comps.pattern[layer][0, head], special)
    kv = model.sites.kv_head_of(head)
    terms = parts.terms(head, kv, query, key)
    names = parts.names

    def top(values: torch.Tensor, k: int = CARD_TOP) -> list[list]:
        order = values.abs().argsort(descending=True)[:k]
        return [[names[int(c)], round(float(values[c]), 4)] for c in order]

    flat = terms.flatten()
    pairs = flat.abs().argsort(descending=True)[:3]
    vectors = ov.ov_vectors(comps, parts, layer, head, 0, query)  # [n, d]
    out = vectors.sum(0)
    along = vectors @ out / out.norm().clamp_min(1e-30)  # each component's share of |out|, along out
    final = model.final_norm
    x = comps.trace.resid_final[0, query]
    with torch.no_grad():
        held = held_norm(final, x, final(x), model.norm_offset)
    ids = comps.inputs["input_ids"][0]
    checked = {}
    if qk.norms_move(model):  # the query side's largest component taken out, the scales held and free
        name = names[int(terms.sum(1).abs().argmax())]
        at = (torch.tensor([query]), torch.tensor([key]))
        held_r, free_r = (qk.removal(comps, layer, head, name, "query", *at, held=h) for h in (True, False))
        moved = None if free_r.qk_norm_change is None else round(float(free_r.qk_norm_change[0]), 4)
        checked["removal"] = [
            name,
            round(float(held_r.change[0]), 4),
            round(float(free_r.change[0]), 4),
            round(float(free_r.norm_change[0]), 4),
            moved,
        ]
    return {
        **checked,
        "edge": [query, key, round(weight, 4)],
        "tokens": [word(int(ids[query])), word(int(ids[key]))],
        "score": round(float(parts.score(head, kv, query, key)), 4),
        "query": top(terms.sum(1)),
        "key": top(terms.sum(0)),
        "pairs": [[names[int(p) // len(names)], names[int(p) % len(names)], round(float(flat[p]), 4)] for p in pairs],
        "norm": round(float(out.norm()), 4),
        "values": top(along),
        "written": held.linear(out),  # through the final norm: attribution_cards reads its logits, all heads at once
    }


def attribution_cards(model: HookedModel, ids: torch.Tensor, vocab: torch.Tensor | None) -> dict:
    """Every head's card (`card_of`) on the example prompt ids [T], and MAPS's mappings over `vocab`."""
    tok = model.tokenizer
    word: Callable[[int], str] = (lambda t: tok.decode([t])) if tok is not None else str
    comps = qk.record(model, {"input_ids": ids[None].to(model.input_device)})
    special = None if tok is None else torch.isin(ids.cpu(), torch.tensor(list(tok.all_special_ids), dtype=ids.dtype))
    cards: dict[str, dict] = {}
    comps.stack(model.n_layers, 0)  # every layer's components are the first rows of this one stack
    for layer in range(model.n_layers):
        parts = qk.layer_parts(comps, layer, 0)
        for head in range(model.n_heads):
            cards[head_name(layer, head)] = card_of(comps, parts, layer, head, word, special)
    with torch.no_grad():
        values, tokens = ov.top_tokens(model, torch.stack([card.pop("written") for card in cards.values()]), CARD_TOP)
    for card, v, t in zip(cards.values(), values.tolist(), tokens.tolist()):
        card["writes"] = [[word(token), round(value, 3)] for token, value in zip(t, v)]
    heads = [(l, h) for l in range(model.n_layers) for h in range(model.n_heads)]
    found = ov.maps(model, heads, ATLAS_MAPS, ATLAS_MAPS, vocab)
    maps = {
        head_name(*h): [[word(m.source), round(m.amplification, 4), [word(t) for t, _ in m.targets]] for m in mappings]
        for h, mappings in found.items()
    }
    return {"attribution": cards, "maps": maps, "attribution_error": comps.error}


def atlas_probe(ctx: RunContext, model: HookedModel, options: AtlasOptions) -> dict:
    """The atlas's attribution cards, cached under output.root/atlas/<model>/attribution-<key> like its other
    probes (on the same example prompt as the attention cards); {} with a note on a model the split does not
    cover."""
    try:
        qk.check_model(model)
    except UsageError as e:
        ctx.note(f"atlas: no attribution cards: {e}")
        return {}
    cache = card_cache(ctx, model, options, "attribution", VERSION, ATTRIBUTION)
    if cache.cached:
        return json.loads((cache.where / ATTRIBUTION).read_text())
    data = cache.context.get_data()
    ids = example_prompt(model, cache.first_document(data), cache.cfg.seed)
    vocab = data.inputs["input_ids"].unique().cpu() if cache.text else None
    cards = attribution_cards(model, ids, vocab)
    where = cache.where
    where.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(where / ATTRIBUTION, json.dumps(cards).encode())
    return cards
