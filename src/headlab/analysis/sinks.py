"""Attention sinks per head: how much attention the prompt's first token draws, and which later tokens
draw a disproportionate share (hidden sinks, Yu et al. 2024, "Unveiling and Harnessing Hidden Attention
Sinks", ICML).

Prompts are right-padded (tasks/base.py): every prompt's first real token is position 0, and its real
positions are those the `attention_mask` marks (every position where the task gives none). Per prompt,
layer and head (SINK_QUANTITIES):
  sink_rate              share of the real queries after the first that put more than epsilon of their
                         attention on the first token. The first query is left out: it sees only itself,
                         so it would be a sink query of every head.
  first_token_attention  those queries' mean attention on the first token
  hidden_sink_count      real tokens after the first that are attention sinks by Yu et al.'s rule: the
                         attention the token receives, averaged over the real queries that see it (those at
                         or after it, as the authors' code averages), exceeds alpha / N, N the prompt's
                         real length (their alpha: 5)
  hidden_sink_share      hidden_sink_count over the prompt's N - 1 tokens after the first
  hidden_sink_mass       the real queries' (after the first) mean attention on the prompt's hidden sinks
  gu_first_token_attention  Gu et al. 2024's alpha_1 ("When Attention Sink Emerges in Language Models"):
                         the mean attention on the first token over ALL the real queries, the first one
                         (which sees only itself, so puts 1 there) included, as their code averages
  gu_sink                1 where gu_first_token_attention exceeds epsilon: the head is a sink head of
                         this prompt by their metric, else 0

Gu et al.'s model-level Sink_1^epsilon (`sink_1`): per prompt, the share (%) of the model's heads that are
sink heads, then the mean over prompts (their code thresholds each sequence's alpha_1, then averages the
indicator over sequences, layers and heads). Their sequences are T tokens exactly (T = 64): `exact_length`
cuts the prompts to T and leaves out those shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..interventions.sinks import ALPHA, hidden_sinks, real_tokens
from ..models.hooked import HookedModel
from ..tasks import TaskData

SINK_QUANTITIES = (
    "sink_rate",
    "first_token_attention",
    "hidden_sink_count",
    "hidden_sink_share",
    "hidden_sink_mass",
    "gu_first_token_attention",
    "gu_sink",
)
GU_SINK = SINK_QUANTITIES.index("gu_sink")


@dataclass
class SinkScores:
    quantities: Tensor  # [layers * heads, prompts, len(SINK_QUANTITIES)], heads layer-major
    hidden: Tensor  # [prompts, pos]: in how many heads (of every layer) each token is a hidden sink
    real: Tensor  # [prompts, pos] bool: the real tokens


def sink_quantities(pattern: Tensor, real: Tensor, epsilon: float, alpha: float = ALPHA, fixed: float = 0.0) -> Tensor:
    """pattern [batch, head, query, key], real [batch, pos] bool -> [batch, head, 7]: SINK_QUANTITIES."""
    later = pattern[..., 1:, :]  # the queries after the first
    counted = real[:, None, 1:].to(pattern.dtype)
    n = counted.sum(-1).clamp(min=1)
    on_first = later[..., 0]
    rate = ((on_first > epsilon).to(pattern.dtype) * counted).sum(-1) / n
    mean = (on_first * counted).sum(-1) / n
    hidden = hidden_sinks(pattern, real, alpha, fixed)
    count = hidden.sum(-1).to(pattern.dtype)
    share = count / (real.sum(-1) - 1).clamp(min=1)[:, None]
    on_hidden = (later * hidden[:, :, None, :]).sum(-1)
    mass = (on_hidden * counted).sum(-1) / n
    every = real[:, None, :].to(pattern.dtype)  # Gu et al. count the first query too
    gu = (pattern[..., 0] * every).sum(-1) / every.sum(-1).clamp(min=1)
    gu_sink = (gu > epsilon).to(pattern.dtype)
    return torch.stack([rate, mean, count, share, mass, gu, gu_sink], dim=-1)


def sink_1(scores: SinkScores) -> Tensor:
    """[prompts]: Gu et al.'s Sink_1^epsilon of each prompt, the share (%) of all heads that are sink heads."""
    return 100 * scores.quantities[..., GU_SINK].double().mean(0)  # float32 would round the share


def exact_length(data: TaskData, seq_len: int) -> TaskData:
    """The prompts of `seq_len` real tokens or more, each cut to its first `seq_len` (Gu et al.'s sequences
    of T tokens exactly); the others left out. Only the inputs are kept: the sink scores read nothing else."""
    real = real_tokens(data)
    keep = real.sum(-1) >= seq_len
    inputs = {name: value[keep, :seq_len] for name, value in data.inputs.items()}
    return TaskData(inputs=inputs, positions=torch.zeros(int(keep.sum()), 1, dtype=torch.long), answers={})


@torch.no_grad()
def sink_scores(
    model: HookedModel,
    data: TaskData,
    epsilon: float = 0.3,
    alpha: float = ALPHA,
    batch_size: int = 16,
    fixed: float = 0.0,
) -> SinkScores:
    """SINK_QUANTITIES of every head (layer-major) on every prompt, and where the hidden sinks are."""
    real = real_tokens(data)
    parts, hidden = [], []
    for start in range(0, real.shape[0], batch_size):
        batch = {k: v[start : start + batch_size] for k, v in data.inputs.items()}
        rows = real[start : start + batch_size]
        with model.sites.record(sites=("pattern",)) as seen:
            model.forward_blocks(batch)
        patterns = [seen[("pattern", layer)].float() for layer in range(model.n_layers)]
        rows = rows.to(patterns[0].device)
        parts.append(torch.stack([sink_quantities(p, rows, epsilon, alpha, fixed) for p in patterns], 1).cpu())
        hidden.append(torch.stack([hidden_sinks(p, rows, alpha, fixed).sum(1) for p in patterns]).sum(0).cpu())
    quantities = torch.cat(parts).flatten(1, 2)  # [prompts, layers * heads, len(SINK_QUANTITIES)]
    return SinkScores(quantities.transpose(0, 1), torch.cat(hidden), real.cpu())


def most_often(scores: SinkScores, ids: Tensor, n_heads: int, k: int = 5, min_seen: int = 5) -> tuple[list, list]:
    """The positions and the token ids most often hidden sinks, each [(position or id, share, count)]:
    count = the (head, prompt) pairs in which it is a hidden sink, share = count over the pairs in which
    it is a real token after the first; largest share first, among those seen in `min_seen` pairs or more
    (a position that one long prompt alone reaches says little)."""
    later = scores.real.clone()
    later[:, 0] = False
    hidden = scores.hidden.long() * later
    at_position = (hidden.sum(0), later.long().sum(0) * n_heads)
    size = int(ids.max()) + 1
    flat_ids = ids.cpu()[later]
    of_token = (
        torch.zeros(size, dtype=torch.long).index_add_(0, flat_ids, hidden[later]),
        torch.zeros(size, dtype=torch.long).index_add_(0, flat_ids, torch.ones_like(flat_ids)) * n_heads,
    )
    return _top(*at_position, k, min_seen), _top(*of_token, k, min_seen)


def _top(count: Tensor, seen: Tensor, k: int, min_seen: int) -> list[tuple[int, float, int]]:
    share = count.double() / seen.clamp(min=1)
    share[(seen < min_seen) | (count == 0)] = -1  # too rarely seen to rank, or never a sink
    order = share.argsort(descending=True)[:k]
    return [(int(i), float(share[i]), int(count[i])) for i in order if share[i] >= 0]
