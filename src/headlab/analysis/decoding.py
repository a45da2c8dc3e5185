"""Greedy decoding that keeps, at every step, each head's most-attended key (Wu et al. 2024's retrieval
heads are read off it: analysis/retrieval.py), optionally stopping at a newline and with heads masked.

The prompts are decoded in batches, into a buffer of the prompt and one position per step after it. One
pass over the buffer keeps every layer's keys and values (HookedModel.trace, with no pattern made, so
that long prompts cost what a plain forward pass costs); each step then runs the blocks on the newest
query's position alone, attending to the kept keys and values before it (run_blocks' suffix runs, the
engine's own), and writes that position's keys and values into the kept ones, in place: a key-value
cache that no step copies (the attention reads it per key/value head, sites.per_copy). The buffer's
positions after the newest query only give the cache its length. A model whose blocks cannot run on a
suffix (runs_suffixes false) runs the whole buffer at every step instead.

Masking (Wu et al.'s needle_in_haystack_with_mask.py): a masked head's query is zeroed at every decoding
step, so that it attends uniformly over what it sees; the prompt's pass is left clean, as their prefill
is. A row stops after the first token that holds a newline (where `stop` says so); later steps are -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..models.hooked import HookedModel, Inputs
from ..progress import progress_bar
from ..vocabulary import Site


@dataclass
class Decoded:
    tokens: Tensor  # [n, steps]: the greedy answer; -1 after a row stopped
    top_keys: (
        Tensor  # [n, layer * head (layer-major), steps]: each head's most-attended key at each step; -1 after a stop
    )


@torch.no_grad()
def greedy_decode(
    model: HookedModel,
    inputs: Inputs,
    prompt_len: int,
    steps: int,
    batch_size: int = 8,
    show_progress: bool = False,
    stop: Tensor | None = None,
    masked: list[tuple[int, int]] | None = None,
) -> Decoded:
    """Decode up to `steps` tokens greedily after the first `prompt_len` positions of each row of `inputs`
    ([n, T >= prompt_len], one length for every row: no padding); step t's query is position
    prompt_len - 1 + t, the one that reads the token decoded at step t - 1. `stop` [vocab] (bool): a row
    ends after decoding one of these tokens. `masked`: (layer, head) whose query is zeroed at every step."""
    n = inputs["input_ids"].shape[0]
    if inputs["input_ids"].shape[1] < prompt_len:
        raise ValueError(f"rows of {inputs['input_ids'].shape[1]} tokens hold no prompt of {prompt_len}")
    tokens = torch.full((n, steps), -1, dtype=torch.long)
    tops = torch.full((n, model.n_layers * model.n_heads, steps), -1, dtype=torch.long)
    with progress_bar("greedy decoding", total=n, enabled=show_progress) as bar:
        for start in range(0, n, batch_size):
            rows = slice(start, start + batch_size)
            batch = {k: _buffer(v[rows, :prompt_len], steps).to(model.input_device) for k, v in inputs.items()}
            got_tokens, got_tops = _decode_batch(model, batch, prompt_len, steps, stop, masked or [])
            tokens[rows, : got_tokens.shape[1]] = got_tokens.cpu()
            tops[rows, :, : got_tops.shape[2]] = got_tops.cpu()
            bar.update(min(n, start + batch_size))
    return Decoded(tokens, tops)


def _buffer(t: Tensor, steps: int) -> Tensor:
    """The prompt and steps - 1 positions after it: the last prompt token repeated (ids), ones (masks)."""
    return torch.cat([t, t[:, -1:].expand(-1, steps - 1)], 1) if steps > 1 else t


def _decode_batch(
    model: HookedModel, batch: Inputs, prompt_len: int, steps: int, stop: Tensor | None, masked: list[tuple[int, int]]
) -> tuple[Tensor, Tensor]:
    ids = batch["input_ids"].clone()
    b = ids.shape[0]
    suffix = model.runs_suffixes
    trace = model.trace(batch, keep_kv=True, every_input=False) if suffix else None
    at_start = torch.zeros((b, 1), dtype=torch.long, device=ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)
    tokens: list[Tensor] = []
    tops: list[Tensor] = []
    for t in range(steps):
        p = prompt_len - 1 + t
        if t:
            ids[:, p] = tokens[-1].clamp(min=0)
        current = {**batch, "input_ids": ids}
        if trace is not None:
            h = model.embed(current)[:, p : p + 1]
            with ExitStack() as stack:
                seen = stack.enter_context(_top_keys(model, 0))
                stack.enter_context(_masked_queries(model, masked, 0))
                kv = stack.enter_context(model.sites.record(sites=(Site.k, Site.v)))
                h = model.run_blocks(h, 0, trace, read=at_start, from_position=p, to_position=p + 1)
            for layer in range(model.n_layers):
                keys, values = trace.kv[layer]  # type: ignore[index]
                keys[:, :, p] = kv[(Site.k, layer)][:, :, 0]
                values[:, :, p] = kv[(Site.v, layer)][:, :, 0]
            logits = model.readout(h, at_start)[:, 0]
        else:
            with _top_keys(model, p) as seen, _masked_queries(model, masked, prompt_len - 1):
                h = model.forward_blocks(current)
            logits = model.readout(h, at_start + p)[:, 0]
        token = logits.argmax(-1)
        top = torch.cat([seen[layer] for layer in range(model.n_layers)], 1)
        tokens.append(token.masked_fill(done, -1))
        tops.append(top.masked_fill(done[:, None], -1))
        if stop is not None:
            done = done | stop.to(token.device)[token]
            if done.all():
                break
    return torch.stack(tokens, 1), torch.stack(tops, 2)


def _top_keys(model: HookedModel, row: int) -> AbstractContextManager[dict[int, Tensor]]:
    """layer -> [b, head]: the key of highest attention from query row `row` of each pattern (ties to the
    earliest key), kept as the pass runs."""
    return model.kept(Site.pattern, lambda pattern: pattern[:, :, row].argmax(-1))


@contextmanager
def _masked_queries(model: HookedModel, heads: list[tuple[int, int]], start: int) -> Iterator[None]:
    """The queries of `heads` zeroed at positions start.. of each pass."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    with ExitStack() as stack:
        for layer, which in by_layer.items():
            stack.enter_context(model.sites.hooks(layer, q=_zeroed(which, start)))
        yield


def _zeroed(heads: list[int], start: int) -> Callable[[Tensor], Tensor]:
    def hook(q: Tensor) -> Tensor:
        q = q.clone()
        q[:, heads, start:] = 0
        return q

    return hook


def newline_tokens(tokenizer: Any, rows: int) -> Tensor:
    """[rows] bool: the tokens whose text holds a newline. Wu et al. stop at their tokenizer's lone newline
    token ("<0x0A>", or id 144); a token of several newlines, or of a newline and more, stops here too."""
    texts = tokenizer.batch_decode([[i] for i in range(rows)])
    return torch.tensor(["\n" in text for text in texts], dtype=torch.bool)


def max_positions(model: HookedModel) -> int | None:
    """The longest sequence the model reads (a toy's n_ctx, a transformers config's positions), or None."""
    module = model.module
    for config, name in (
        (getattr(module, "cfg", None), "n_ctx"),
        (getattr(module, "config", None), "max_position_embeddings"),
    ):
        limit = getattr(config, name, None)
        if isinstance(limit, int):
            return limit
    return None
