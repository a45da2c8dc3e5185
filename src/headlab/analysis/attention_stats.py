"""What a head's attention looks like on ordinary text, and what its output writes: the descriptive side
of the head atlas (studies/atlas.py).

Per prompt, layer and head (ATTENTION_QUANTITIES), over the prompt's real queries (its attention_mask; a
right-padded prompt's first real token is position 0):
  attention_entropy   the mean over queries of -sum_k p_k log p_k (nats) over the keys it sees; the first
                      query sees only itself, so its entropy is 0 and it is counted like any other
  attention_distance  the mean over queries of sum_k p_k (q - k): how far back the head looks, in tokens
                      (Vig & Belinkov 2019's mean attention distance, per query rather than per token pair)

Per head, for the atlas's cards (AttentionProfile):
  received      attention mass each token id the prompts hold receives (`tokens`, one column each: not a
                column per id of the vocabulary), summed over every real query of every prompt: the
                tokens the head attends to most
  output        the head's mean output z W_O over every real token, in the residual stream: the tokens its
                OV circuit writes most are the logit lens of it (final norm, then W_U), as W_O W_U read on
                the text the head actually sees
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.hooked import HookedModel
from ..tasks import TaskData
from .sinks import real_tokens  # the sink scores' reading of a prompt's real tokens

ATTENTION_QUANTITIES = ("attention_entropy", "attention_distance")
LENS_COLUMNS = 4096  # tokens of the unembedding the logit lens reads out at once


def entropy_and_distance(pattern: Tensor, real: Tensor) -> Tensor:
    """pattern [batch, head, query, key], real [batch, pos] bool -> [batch, head, 2]: ATTENTION_QUANTITIES."""
    p = pattern.float()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [batch, head, query]
    pos = torch.arange(p.shape[-1], device=p.device)
    back = (pos[:, None] - pos[None, :]).clamp(min=0).to(p.dtype)  # [query, key]
    distance = (p * back).sum(-1)
    queries = real[:, None, : p.shape[-2]].to(p.dtype)
    n = queries.sum(-1).clamp(min=1)
    return torch.stack([(entropy * queries).sum(-1) / n, (distance * queries).sum(-1) / n], dim=-1)


@dataclass
class AttentionProfile:
    quantities: Tensor  # [layer * head (layer-major), prompts, len(ATTENTION_QUANTITIES)]
    received: Tensor  # [layer * head, len(tokens)]: attention mass each of `tokens` receives
    tokens: Tensor  # [m]: the token ids the prompts hold, sorted (received's columns)
    output: Tensor  # [layer * head, d_model]: the head's mean output z W_O over the real tokens


@torch.no_grad()
def attention_profile(model: HookedModel, data: TaskData, batch_size: int = 8) -> AttentionProfile:
    """ATTENTION_QUANTITIES per head and prompt, and each head's received attention and mean output."""
    real = real_tokens(data)
    ids = data.inputs["input_ids"]
    heads = model.n_layers * model.n_heads
    tokens = torch.unique(ids.cpu())  # sorted; a column per id the prompts hold, not per id of the vocabulary
    columns = torch.searchsorted(tokens, ids.cpu())
    received = torch.zeros(heads, len(tokens), dtype=torch.float64)
    output = torch.zeros(heads, model.sites.d_model, dtype=torch.float64)
    parts = []
    for start in range(0, ids.shape[0], batch_size):
        batch = {k: v[start : start + batch_size] for k, v in data.inputs.items()}
        rows = real[start : start + batch_size]
        with model.sites.record(sites=("pattern", "z")) as seen:
            model.forward_blocks(batch)
        rows_dev = rows.to(seen[("pattern", 0)].device)
        per_layer = []
        for layer in range(model.n_layers):
            pattern = seen[("pattern", layer)].float()  # [b, head, q, k]
            per_layer.append(entropy_and_distance(pattern, rows_dev).cpu())
            on_keys = (pattern * rows_dev[:, None, :, None]).sum(2)  # [b, head, key]: from real queries
            flat_ids = columns[start : start + batch_size].reshape(-1)
            mass = on_keys.permute(1, 0, 2).reshape(model.n_heads, -1).double().cpu()
            block = slice(layer * model.n_heads, (layer + 1) * model.n_heads)
            received[block].index_add_(1, flat_ids, mass)
            z = seen[("z", layer)].float()  # [b, pos, head, d_head]
            out = torch.einsum("bphd,hdm->hm", z * rows_dev[:, :, None, None], model.sites.W_O(layer).float())
            output[block] += out.double().cpu()
        parts.append(torch.stack(per_layer, 1))  # [b, layer, head, 2]
    quantities = torch.cat(parts).flatten(1, 2).transpose(0, 1)  # [layer * head, prompts, 2]
    return AttentionProfile(quantities, received, tokens, output / real.sum().clamp(min=1))


@torch.no_grad()
def logit_lens_top(
    model: HookedModel, vectors: Tensor, k: int = 5, columns: int = LENS_COLUMNS
) -> tuple[Tensor, Tensor]:
    """vectors [m, d_model] in the residual stream -> (logits [m, k], token ids [m, k]): the k tokens each
    vector raises most when read out alone (final norm, then the unembedding).

    The unembedding is read `columns` tokens at a time, each slice's top k merged into the running top k:
    m x columns logits at once, not m x vocabulary (72 heads x 262,144 tokens: 75 MB for gemma3-270m)."""
    weight = model.unembed.weight
    bias = getattr(model.unembed, "bias", None)
    assert isinstance(weight, Tensor)
    x = model.final_norm(vectors.to(weight.device, weight.dtype))
    tok = model.tokenizer
    vocab = weight.shape[0] if tok is None else min(weight.shape[0], len(tok))  # a padded row names no token
    k = min(k, vocab)
    values, ids = x.new_empty(len(x), 0, dtype=torch.float32), torch.empty(len(x), 0, dtype=torch.long, device=x.device)
    for start in range(0, vocab, columns):
        end = min(start + columns, vocab)
        logits = F.linear(x, weight[start:end], None if bias is None else bias[start:end]).float()
        top = logits.topk(min(k, end - start), dim=-1)
        values, ids = torch.cat([values, top.values], -1), torch.cat([ids, top.indices + start], -1)
        best = values.topk(min(k, values.shape[-1]), dim=-1)
        values, ids = best.values, ids.gather(-1, best.indices)
    return values.cpu(), ids.cpu()


@torch.no_grad()
def example_patterns(model: HookedModel, ids: Tensor) -> Tensor:
    """ids [pos] -> [layer * head, pos, pos]: every head's attention pattern on one prompt."""
    with model.sites.record(sites=("pattern",)) as seen:
        model.forward_blocks({"input_ids": ids[None].to(model.input_device)})
    return torch.cat([seen[("pattern", layer)][0].float().cpu() for layer in range(model.n_layers)])
