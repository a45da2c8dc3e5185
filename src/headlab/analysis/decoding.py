"""Greedy decoding that keeps, at every step, each head's most-attended key (Wu et al. 2024's retrieval
heads are read off it: analysis/retrieval.py).

The prompts are decoded in batches. The first step is one pass over the prompt that keeps every layer's
keys and values (HookedModel.trace); each later step runs the blocks on the newest token's position and
after, attending to the kept keys and values before it (run_blocks' suffix runs, the engine's own), and
writes that position's keys and values into the kept ones: a key-value cache. The positions after the
newest token are scaffolding (the row's own tokens there): causal attention keeps them from changing
anything before them, and they are overwritten as the answer grows. A model whose blocks cannot run on a
suffix (runs_suffixes false) runs the whole sequence at every step instead.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.hooked import HookedModel, Inputs
from ..progress import progress_bar
from ..vocabulary import Site


@dataclass
class Decoded:
    tokens: Tensor  # [n, steps]: the greedy answer
    top_keys: Tensor  # [n, layer * head (layer-major), steps]: each head's most-attended key at each step


@torch.no_grad()
def greedy_decode(
    model: HookedModel, inputs: Inputs, prompt_len: int, steps: int, batch_size: int = 8, show_progress: bool = False
) -> Decoded:
    """Decode `steps` tokens greedily after the first `prompt_len` positions of each row of `inputs`
    ([n, T], T >= prompt_len + steps - 1, one length for every row: no padding); step t's query is
    position prompt_len - 1 + t, the one that reads the token decoded at step t - 1."""
    n = inputs["input_ids"].shape[0]
    end = prompt_len + steps - 1
    if inputs["input_ids"].shape[1] < end:
        raise ValueError(f"rows of {inputs['input_ids'].shape[1]} tokens hold no {steps} steps after {prompt_len}")
    tokens, tops = [], []
    with progress_bar("greedy decoding", total=n, enabled=show_progress) as bar:
        for start in range(0, n, batch_size):
            batch = {k: v[start : start + batch_size, :end].to(model.input_device) for k, v in inputs.items()}
            got_tokens, got_tops = _decode_batch(model, batch, prompt_len, steps)
            tokens.append(got_tokens.cpu())
            tops.append(got_tops.cpu())
            bar.update(min(n, start + batch_size))
    return Decoded(torch.cat(tokens), torch.cat(tops))


def _decode_batch(model: HookedModel, batch: Inputs, prompt_len: int, steps: int) -> tuple[Tensor, Tensor]:
    ids = batch["input_ids"].clone()
    b = ids.shape[0]
    first = torch.full((b, 1), prompt_len - 1, device=ids.device)
    with _top_keys(model, prompt_len - 1) as seen:
        trace = model.trace(batch, keep_kv=model.runs_suffixes)
    token = model.readout(trace.resid_final, first)[:, 0].argmax(-1)
    tokens, tops = [token], [torch.cat([seen[layer] for layer in range(model.n_layers)], 1)]
    at_start = torch.zeros((b, 1), dtype=torch.long, device=ids.device)
    for t in range(1, steps):
        p = prompt_len - 1 + t
        ids[:, p] = token
        current = {**batch, "input_ids": ids}
        if model.runs_suffixes:
            h = model.embed(current)[:, p:]
            with _top_keys(model, 0) as seen, model.sites.record(sites=(Site.k, Site.v)) as kv:
                h = model.run_blocks(h, 0, trace, read=at_start, from_position=p)
            for layer in range(model.n_layers):
                keys, values = trace.kv[layer]  # type: ignore[index]
                keys[:, :, p] = kv[(Site.k, layer)][:, :, 0]
                values[:, :, p] = kv[(Site.v, layer)][:, :, 0]
            token = model.readout(h, at_start)[:, 0].argmax(-1)
        else:
            with _top_keys(model, p) as seen:
                h = model.forward_blocks(current)
            token = model.readout(h, first + t)[:, 0].argmax(-1)
        tokens.append(token)
        tops.append(torch.cat([seen[layer] for layer in range(model.n_layers)], 1))
    return torch.stack(tokens, 1), torch.stack(tops, 2)


def _top_keys(model: HookedModel, row: int) -> AbstractContextManager[dict[int, Tensor]]:
    """layer -> [b, head]: the key of highest attention from query row `row` of each pattern (ties to the
    earliest key), kept as the pass runs."""
    return model.kept(Site.pattern, lambda pattern: pattern[:, :, row].argmax(-1))
