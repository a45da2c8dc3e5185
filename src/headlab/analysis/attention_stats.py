"""What a head's attention looks like on ordinary text, and what its output writes: the descriptive side
of the head atlas (studies/atlas.py).

Per prompt, layer and head (ATTENTION_QUANTITIES), over the prompt's real queries (its attention_mask; a
right-padded prompt's first real token is position 0):
  attention_entropy   the mean over queries of -sum_k p_k log p_k (nats) over the keys it sees; the first
                      query sees only itself, so its entropy is 0 and it is counted like any other
  attention_distance  the mean over queries of sum_k p_k (q - k): how far back the head looks, in tokens
                      (Vig & Belinkov 2019's mean attention distance, per query rather than per token pair)

Per head, for the atlas's cards (AttentionProfile):
  received      attention mass each token id receives, summed over every real query of every prompt: the
                tokens the head attends to most
  output        the head's mean output z W_O over every real token, in the residual stream: the tokens its
                OV circuit writes most are the logit lens of it (final norm, then W_U), as W_O W_U read on
                the text the head actually sees
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.hooked import HookedModel
from ..tasks import TaskData
from .sinks import real_tokens  # the sink scores' reading of a prompt's real tokens

ATTENTION_QUANTITIES = ("attention_entropy", "attention_distance")


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
    received: Tensor  # [layer * head, vocab]: attention mass each token id receives
    output: Tensor  # [layer * head, d_model]: the head's mean output z W_O over the real tokens


@torch.no_grad()
def attention_profile(model: HookedModel, data: TaskData, batch_size: int = 8) -> AttentionProfile:
    """ATTENTION_QUANTITIES per head and prompt, and each head's received attention and mean output."""
    real = real_tokens(data)
    ids = data.inputs["input_ids"]
    heads = model.n_layers * model.n_heads
    vocab = int(ids.max()) + 1
    received = torch.zeros(heads, vocab, dtype=torch.float64)
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
            flat_ids = batch["input_ids"].reshape(-1).cpu()
            mass = on_keys.permute(1, 0, 2).reshape(model.n_heads, -1).double().cpu()
            block = slice(layer * model.n_heads, (layer + 1) * model.n_heads)
            received[block].index_add_(1, flat_ids, mass)
            z = seen[("z", layer)].float()  # [b, pos, head, d_head]
            out = torch.einsum("bphd,hdm->hm", z * rows_dev[:, :, None, None], model.sites.W_O(layer).float())
            output[block] += out.double().cpu()
        parts.append(torch.stack(per_layer, 1))  # [b, layer, head, 2]
    quantities = torch.cat(parts).flatten(1, 2).transpose(0, 1)  # [layer * head, prompts, 2]
    return AttentionProfile(quantities, received, output / real.sum().clamp(min=1))


@torch.no_grad()
def logit_lens_top(model: HookedModel, vectors: Tensor, k: int = 5) -> tuple[Tensor, Tensor]:
    """vectors [m, d_model] in the residual stream -> (logits [m, k], token ids [m, k]): the k tokens each
    vector raises most when read out alone (final norm, then the unembedding)."""
    weight = model.unembed.weight
    assert isinstance(weight, Tensor)
    x = vectors.to(weight.device, weight.dtype)
    logits = model.unembed(model.final_norm(x)).float()
    tok = model.tokenizer
    if tok is not None and logits.shape[-1] > len(tok):  # a padded unembedding's rows name no token
        logits = logits[:, : len(tok)]
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return top.values.cpu(), top.indices.cpu()


@torch.no_grad()
def example_patterns(model: HookedModel, ids: Tensor) -> Tensor:
    """ids [pos] -> [layer * head, pos, pos]: every head's attention pattern on one prompt."""
    with model.sites.record(sites=("pattern",)) as seen:
        model.forward_blocks({"input_ids": ids[None].to(model.input_device)})
    return torch.cat([seen[("pattern", layer)][0].float().cpu() for layer in range(model.n_layers)])
