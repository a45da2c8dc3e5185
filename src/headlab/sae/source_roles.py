"""What an attention-output SAE feature does, read from where its attention comes from (Kissane et al. 2024,
arXiv 2406.17759, sections 3-4).

Kissane et al. read each feature's dashboard, its top-activating contexts and the source tokens its direct
feature attribution (DFA) points at, and group features into families by what the attention does:
induction, local (short-range) context, high-level (long-range) context, and the known head roles (previous
token, duplicate token, attention to the first token). Here that reading is made computable. For each
of a feature's top-activating contexts (destination t in a row of token ids), its pre-activation splits
exactly over source positions s (sae/head_attribution.direct_feature_attribution, summed over heads):

    dfa[s] = sum_h pattern[h, t, s] (v[h, s] . W_enc[head h, f])

and each source position has a role relative to t, the first that holds:

    first token       s = 0 (where attention sinks sit)
    current token     s = t
    previous token    s = t - 1
    induction         the token before s is the current token (s follows an earlier copy of it)
    same token        the source is the current token again (a duplicate)
    local context     t - s <= LOCAL_WINDOW
    long range        any other

The context's role is the role holding the most positive DFA (what drives the feature up); the feature's
roles over its top contexts form its class distribution, so sae/head_attribution.head_roles reads a head's
top features' roles from these classes as it reads context classes, and calls a head polysemantic when two
of its top features have unrelated roles. Where headlab differs from Kissane et al.: roles are read off
the DFA by these rules, not by a person from dashboards (their logit effects and top tokens are not read);
the roles are the families their paper names, no finer ("successor", "name mover" are not told apart).
"""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..models.hooked import HookedModel
from .activations import Corpus
from .base import SparseAutoencoder

SOURCE_ROLES = (
    "first token",
    "current token",
    "previous token",
    "induction",
    "same token",
    "local context",
    "long range",
)
# Tokens back from the destination that still count as its local context: a clause of prose
LOCAL_WINDOW = 8


def source_classes(ids: Int[Tensor, " pos"], dest: Int[Tensor, " c"]) -> Int[Tensor, "c pos"]:
    """The role (index into SOURCE_ROLES) of every source position s <= t for destinations `dest` in one
    row of token ids; -1 after the destination (causal attention never reads there)."""
    pos = torch.arange(len(ids))
    s, t = pos[None, :], dest[:, None]
    current = ids[dest][:, None]
    before = torch.cat([ids.new_full((1,), -1), ids[:-1]])[None, :]  # the token before each source
    rules = [
        s == 0,
        s == t,
        s == t - 1,
        (before == current) & (s < t),
        (ids[None, :] == current) & (s < t),
        t - s <= LOCAL_WINDOW,
    ]
    out = torch.full((len(dest), len(ids)), len(SOURCE_ROLES) - 1, dtype=torch.long)
    for role in reversed(range(len(rules))):  # the first rule that holds wins
        out = torch.where(rules[role], role, out)
    return out.masked_fill(s > t, -1)


@torch.no_grad()
def source_role_grid(
    model: HookedModel,
    layer: int,
    sae: SparseAutoencoder,
    corpus: Corpus,
    locate: Int[Tensor, "tokens 2"],
    values: Float[Tensor, "k d_sae"],
    where: Int[Tensor, "k d_sae"],
    batch: int,
) -> Int[Tensor, "k d_sae"]:
    """[k, d_sae]: the source role of each feature's top contexts (values, where: sae/head_attribution.
    top_activations over the corpus's real tokens, `locate` each token's (row, position)); -1 where a
    feature did not fire there or no source drives it up."""
    grid = torch.full(values.shape, -1, dtype=torch.long)
    fired = values > 0
    rank, feature = fired.nonzero(as_tuple=True)
    row_pos = locate[where[rank, feature]]  # [c, 2]
    n_heads = model.sites.n_heads
    w = sae.W_enc.detach().float().view(n_heads, -1, sae.d_sae)  # [H, d_head, d_sae]
    for start in range(0, corpus.ids.shape[0], batch):
        rows = torch.arange(start, min(start + batch, corpus.ids.shape[0]))
        with model.sites.record(("pattern", "v"), layers=[layer]) as store:
            model.forward_blocks({"input_ids": corpus.ids[rows].to(model.input_device)})
        pattern, v = (
            store[("pattern", layer)].float().cpu(),
            store[("v", layer)].float().cpu(),
        )  # [b, H, q, k], [b, kv, k, d]
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # one per query head
        for i, r in enumerate(rows.tolist()):
            mine = (row_pos[:, 0] == r).nonzero().flatten()
            if not len(mine):
                continue
            dest, f = row_pos[mine, 1], feature[mine]
            per_source = torch.einsum("hsd,hdc->chs", v[i], w[:, :, f])  # [c, H, pos]: v[h, s] . W_enc[h, f]
            dfa = (pattern[i][:, dest, :].transpose(0, 1) * per_source).sum(1)  # [c, pos]
            classes = source_classes(corpus.ids[r], dest)
            mass = torch.zeros(len(mine), len(SOURCE_ROLES))
            positive = dfa.clamp_min(0).masked_fill(classes < 0, 0)
            mass.scatter_add_(1, classes.clamp_min(0), positive)
            role = mass.argmax(1).masked_fill(mass.sum(1) <= 0, -1)
            grid[rank[mine], f] = role
    return grid


def role_column(rows: pd.DataFrame) -> str:
    """The column naming the role of top_features_in_role rows: source_role (a table written before source
    roles: context_class)."""
    return "source_role" if "source_role" in rows and rows["source_role"].notna().any() else "context_class"
