"""From SAE features to heads (Kissane et al. 2024, arXiv 2406.17759, section 3; their released code:
github.com/ckkissane/attention-output-saes, top_feature_analysis.py):

decoder_head_shares       weight-based: the share of a feature's decoder norm on each head,
                          ||W_dec[f, head h]|| / sum_h' ||W_dec[f, head h']|| (their
                          get_all_decoder_weights_distributions)
head_roles                per head, Kissane et al.'s reading of it made computable: its top
                          sae.head_features features by that share (their code: the top 10 by
                          torch.topk of the head's column, whatever the share), each feature's role
                          the class distribution of its top-activating contexts (sae/contexts.py),
                          and polysemantic when two of those features have unrelated roles: their
                          class distributions overlap (sum over classes of the smaller share) less than
                          UNRELATED_OVERLAP. Kissane et al. read each head's top 10 features' dashboards
                          by eye, grouped them, and called a head polysemantic when it had "multiple
                          unrelated roles" (at least 90% of GPT-2 small's 144 heads). Where headlab
                          differs: roles are coarse context classes read off the text (or the task's
                          roles), not a person's reading of dashboards (activations, logit effects); a
                          feature's contexts are its sae.top_contexts largest activations on the held-out
                          tokens, not quantiles over a million tokens; dead features (no held-out
                          activation) are skipped, where their top 10 could include one
head_polysemanticity      the old rule, kept under the names *_dominated: per head the live features it
                          dominates (share >= sae.dominance), their effective number (exp of the entropy
                          of their firing frequencies; multi_feature: at least 2), and polysemantic when
                          two of them have unrelated roles. Where features spread over the heads (few
                          reach the dominance share) it reads no head as polysemantic whatever the heads do
direct_feature_attribution  a feature's pre-activation is linear in z, and z of head h at the query
                          position is sum_s pattern[h, q, s] v[h, s]; so the pre-activation splits
                          exactly into pattern[h, q, s] (v[h, s] . W_enc[head h, f]) per head and source
                          position, plus b_enc[f] - b_dec . W_enc[:, f]
top_activations           the k largest activations of every feature over a token set, in chunks
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..models.hooked import HookedModel
from .base import SparseAutoencoder


def decoder_head_shares(sae: SparseAutoencoder, n_heads: int) -> Tensor:
    """[d_sae, n_heads], rows sum to 1."""
    norms = sae.W_dec.detach().view(sae.d_sae, n_heads, -1).norm(dim=-1)
    return norms / norms.sum(1, keepdim=True).clamp_min(1e-12)


# Two features whose contexts share less than half their class mass do different things: a head with
# such a pair is polysemantic. Half, so that two features with the same majority class never count.
UNRELATED_OVERLAP = 0.5


def class_distributions(classes: Tensor) -> Tensor:
    """classes [k, d_sae]: the context class of each feature's top contexts (-1: no context there).
    [d_sae, n_classes]: each feature's share of contexts per class (rows of zeros: no context)."""
    n_classes = int(classes.max()) + 1 if classes.numel() else 0
    counts = torch.zeros(classes.shape[1], max(n_classes, 1))
    seen = classes >= 0
    feature = torch.arange(classes.shape[1]).expand_as(classes)
    counts.index_put_((feature[seen], classes[seen]), torch.ones(int(seen.sum())), accumulate=True)
    return counts / counts.sum(1, keepdim=True).clamp_min(1)


def least_overlap(dist: Tensor) -> float:
    """The least overlap of two rows of class distributions dist [f, n_classes]; nan under two rows."""
    overlap = torch.minimum(dist[:, None, :], dist[None, :, :]).sum(-1)  # [f, f], 1 on the diagonal
    off = overlap[~torch.eye(len(dist), dtype=torch.bool)]
    return float(off.min()) if off.numel() else math.nan


def head_roles(shares: Tensor, frequency: Tensor, classes: Tensor, n_top: int) -> list[dict]:
    """One dict per head, read off its top n_top live features by decoder share (ties: lower feature
    first) among those with contexts: n_top_features (fewer where fewer features are live),
    top_feature_share (their mean share on this head), roles (n_classes counts: how many of them have
    each class as their majority class, ties to the lower class), n_roles (classes with a count),
    largest_role_share (the largest count over n_top_features), min_class_overlap (the least overlap of
    two of their class distributions; nan under two) and polysemantic (0/1: that overlap <
    UNRELATED_OVERLAP). frequency [d_sae]: the fraction of tokens each feature fires on; classes
    [k, d_sae]: see class_distributions."""
    dist = class_distributions(classes)
    readable = (frequency > 0) & (dist.sum(1) > 0)
    candidates = readable.nonzero().squeeze(1)
    out = []
    for h in range(shares.shape[1]):
        order = torch.argsort(-shares[candidates, h], stable=True)[:n_top]
        top = candidates[order]
        d = dist[top]
        roles = torch.bincount(d.argmax(1), minlength=dist.shape[1]) if len(top) else torch.zeros(dist.shape[1])
        least = least_overlap(d)
        out.append(
            {
                "head": h,
                "n_top_features": len(top),
                "top_feature_share": float(shares[top, h].mean()) if len(top) else math.nan,
                "roles": [int(c) for c in roles.tolist()],
                "n_roles": int((roles > 0).sum()),
                "largest_role_share": float(roles.max()) / len(top) if len(top) else math.nan,
                "min_class_overlap": least,
                "polysemantic": float(least < UNRELATED_OVERLAP),
            }
        )
    return out


def random_polysemantic_fraction(frequency: Tensor, classes: Tensor, n_top: int, draws: int, seed: int = 0) -> float:
    """head_roles' rule on features assigned to heads at random (its null rate): the share of `draws` sets of
    n_top readable features, drawn without replacement, whose least class overlap is under UNRELATED_OVERLAP.
    A measured polysemantic share near this one says the rule fires whatever the heads' features are."""
    dist = class_distributions(classes)
    candidates = ((frequency > 0) & (dist.sum(1) > 0)).nonzero().squeeze(1)
    if len(candidates) < 2:
        return math.nan
    gen = torch.Generator().manual_seed(seed)
    size = min(n_top, len(candidates))
    fired = [
        least_overlap(dist[candidates[torch.randperm(len(candidates), generator=gen)[:size]]]) < UNRELATED_OVERLAP
        for _ in range(draws)
    ]
    return sum(fired) / draws


def head_polysemanticity(shares: Tensor, frequency: Tensor, dominance: float, classes: Tensor) -> list[dict]:
    """The old rule. One dict per head: n_dominated, effective_features, multi_feature (effective >= 2),
    n_context_classes_dominated (distinct majority classes of its dominated features),
    min_class_overlap_dominated (the least overlap of two of their class distributions; nan under two
    features with contexts) and polysemantic_dominated (0/1: that overlap < UNRELATED_OVERLAP).
    frequency [d_sae]: the fraction of tokens each feature fires on (dead features count for no head);
    classes [k, d_sae]: see class_distributions."""
    dist = class_distributions(classes)
    out = []
    for h in range(shares.shape[1]):
        mine = (shares[:, h] >= dominance) & (frequency > 0)
        p = frequency[mine] / frequency[mine].sum() if mine.any() else frequency[:0]
        effective = math.exp(float(-(p * p.log()).sum())) if mine.any() else 0.0
        d = dist[mine & (dist.sum(1) > 0)]
        least = least_overlap(d)
        out.append(
            {
                "head": h,
                "n_dominated": int(mine.sum()),
                "effective_features": effective,
                "multi_feature": float(effective >= 2.0),
                "n_context_classes_dominated": len(set(d.argmax(1).tolist())),
                "min_class_overlap_dominated": least,
                "polysemantic_dominated": float(least < UNRELATED_OVERLAP),
            }
        )
    return out


@torch.no_grad()
def direct_feature_attribution(
    model: HookedModel, layer: int, sae: SparseAutoencoder, ids: Tensor, position: int, feature: int
) -> Tensor:
    """[n_heads, pos] for one sequence ids [pos]: each head's and source position's part of the feature's
    pre-activation at `position`."""
    with model.sites.record(("pattern", "v"), layers=[layer]) as store:
        model.forward_blocks({"input_ids": ids[None]})
    pattern, v = store[("pattern", layer)][0], store[("v", layer)][0]  # [H, q, k], [kv_H, k, d_head]
    n_heads = pattern.shape[0]
    v = v.repeat_interleave(n_heads // v.shape[0], dim=0)
    w = sae.W_enc[:, feature].view(n_heads, -1)  # [H, d_head]
    return pattern[:, position, :] * torch.einsum("hkd,hd->hk", v.float(), w)


@torch.no_grad()
def top_activations(sae: SparseAutoencoder, x: Tensor, k: int, batch: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """(values [k, d_sae], token indices into x [k, d_sae], firing frequency [d_sae])."""
    k = min(k, x.shape[0])
    best_v = torch.full((k, sae.d_sae), -math.inf)
    best_i = torch.zeros((k, sae.d_sae), dtype=torch.long)
    fired = torch.zeros(sae.d_sae)
    for start in range(0, x.shape[0], batch):
        f = sae.encode(x[start : start + batch])
        fired += (f > 0).sum(0)
        values = torch.cat([best_v, f])
        index = torch.cat([best_i, torch.arange(start, start + f.shape[0])[:, None].expand_as(f)])
        best_v, order = values.topk(k, dim=0)
        best_i = index.gather(0, order)
    return best_v, best_i, fired / x.shape[0]
