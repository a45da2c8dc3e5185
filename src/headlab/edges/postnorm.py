"""Edges on a model that normalises each component's output before the residual sum (Gemma 2, Gemma 3).

There the residual stream is input + sum_l [post_attn_l(A_l) + post_mlp_l(mlp_l)], A_l = sum_h r_h + b_O with
r_h = z_h W_O[h]: no sum of the heads' outputs. MIB (2504.13151) scores Gemma 2 with hannamw/EAP-IG on
TransformerLens, whose TransformerBlock (transformer_lens/components/transformer_block.py, forward and
apply_mlp, `use_normalization_before_and_after`) applies ln1_post to the attention's summed output and
ln2_post to the MLP's before hook_attn_out and hook_mlp_out. EAP-IG (src/eap/graph.py: AttentionNode,
MLPNode, InputNode, LogitNode; the same in the commit MIB-circuit-track pins, 7af394a) reads:
  senders    a head: attn.hook_result, r_h before ln1_post (abstract_attention.py: per-head z W_O, no
             b_O); an MLP: hook_mlp_out, after ln2_post; the input: hook_embed (Gemma's scaled embedding);
  receivers  hook_{q,k,v}_input, hook_mlp_in and blocks.{L-1}.hook_resid_post: the residual stream as
             read, as for every other model.
Two rules for what patching an edge means follow (EdgeGraph.post_norm, EdgeGraph.of's argument):

`mib` (default): MIB's code. Patching (src/eap/evaluate.py, evaluate_graph's `use_normalization_before_
and_after` branch; get_scores_exact patches one edge with it): a receiver whose edges from heads of
layer i are cut reads, in place of layer i's post_attn_i(A_i), post_attn_i(A_i + sum over those heads of
r_h(corrupt) - r_h(this run)): the norm is run again on each receiver's mixture, so cut heads of one
layer act together, not as a sum; MLP and input edges add their differences. The full circuit is the
clean run and the empty one the corrupted run. Attribution (src/eap/utils.py, make_hooks_and_matrices
with scores: separate_activations is False) multiplies the gradient at the receiver's input by
r_h(corrupt) - r_h(clean), the difference before the norm, with no factor for the norm between r_h and
the residual stream: on this rule EAP and EAP-IG scores are not the first-order change of the exact
score (they miss post_attn's Jacobian, its weight and 1/rms). headlab reproduces both, as MIB does.

`shares`: the post-norm's scale held per run. A head's output is its share of its layer's normalised
output, g * r_h / rms(A_l) of the run it comes from (g the norm's weight, 1 + w for Gemma's), so the
senders of every run sum to its residual stream exactly (an o_proj bias would be nobody's: refused) and
edges patch by adding differences, as on any other model: EAP is then the first-order term of exact
patching, and eap_ig_activations interpolates the attention's normalised output. Where MIB renormalises
a receiver's mixture, this rule adds g * (r_h(corrupt)/rms_corrupt - r_h(clean)/rms_clean).

On both rules the MLP node's output is the normalised one, the input node the residual entering block 0,
and node patching (exact_node_scores) adds a head's patch at its layer's normalised output. OLMo 2 is
refused: its attention reads the residual stream with no norm in front (headlab has no hook there) and its
q and k norms span every head, so a head's receiver is not its own projection columns, as EAP's per-head
gradient assumes; MIB has no OLMo 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..models.norms import norm_factors

if TYPE_CHECKING:
    from ..models.hooked import HookedModel


class EdgeGraph(Protocol):
    """What these rules read of graph.EdgeGraph (which imports this module, so it is not imported here)."""

    @property
    def post_norm(self) -> str | None: ...

    @property
    def senders(self) -> Sequence[Any]: ...

    def head_rows(self, layer: int) -> slice: ...


POST_NORM_RULES = ("mib", "shares")


def check_rule(model: HookedModel, rule: str) -> str | None:
    """The rule `model`'s graph takes (None: a residual sum), refused in one line where edges are not
    defined; an unknown rule is refused for every model."""
    if rule not in POST_NORM_RULES:
        raise UsageError(f"post_norm={rule}: choose one of {', '.join(POST_NORM_RULES)}")
    if model.edges_refused:
        raise UsageError(f"{model.name}: headlab's edges do not cover {model.family}: {model.edges_refused}")
    if model.residual_sum:
        return None
    if model.post_norms is None:
        raise UsageError(
            f"{model.name} normalises each component's output before the residual sum ({model.family}): "
            "its edges are not defined"
        )
    if rule == "shares" and any(getattr(m, "bias", None) is not None for m in model.sites.out_projs or []):
        raise UsageError(f"{model.name}: post_norm=shares needs an attention output with no bias")
    return rule


def attn_out_norm(model: HookedModel, layer: int) -> nn.Module | None:
    """The norm on the attention's output of `layer` (Gemma 2 and 3), None where the family has none."""
    return None if model.post_norms is None else model.post_norms[0][layer]


def attn_norm(model: HookedModel, layer: int) -> nn.Module:
    assert model.post_norms is not None, f"{model.name} has no norm on its components' outputs"
    return model.post_norms[0][layer]


def mlp_norm(model: HookedModel, layer: int) -> nn.Module:
    assert model.post_norms is not None, f"{model.name} has no norm on its components' outputs"
    return model.post_norms[1][layer]


@contextmanager
def attn_output(model: HookedModel, layer: int, fn: Callable[[Tensor, Tensor], Tensor]) -> Iterator[None]:
    """fn(A, post_attn(A)) -> what the attention of `layer` adds to the residual stream."""
    handle = attn_norm(model, layer).register_forward_hook(lambda _m, args, out: fn(args[0], out))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def mlp_output(model: HookedModel, graph: EdgeGraph, layer: int, fn: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """A hook on the MLP node's output, what the MLP adds to the residual stream (after its norm)."""
    if graph.post_norm is None:
        with model.hooks(layer, mlp=fn):
            yield
        return
    handle = mlp_norm(model, layer).register_forward_hook(lambda _m, _a, out: fn(out))
    try:
        yield
    finally:
        handle.remove()


def shares(norm: nn.Module, before: Tensor, after: Tensor, heads: Tensor, offset: float) -> Tensor:
    """[head, n, pos, d]: g * r_h * c, where after = norm(before) = g * before * c (c one number per
    position): c is fitted to the module's own output, so its epsilon and rounding are the norm's (the fit
    in float32 at least: a half-precision sum over d_model would lose the scale's digits)."""
    g = norm_factors(norm, offset).scale
    wide = torch.promote_types(before.dtype, torch.float32)
    gained = before.to(wide) if g is None else before.to(wide) * g.to(wide)
    c = (after.to(wide) * gained).sum(-1, keepdim=True) / (gained * gained).sum(-1, keepdim=True).clamp_min(1e-30)
    return (heads if g is None else heads * g.to(heads.dtype)) * c.to(heads.dtype)


def renormed(model: HookedModel, layer: int, attn: tuple[Tensor, Tensor], added: Tensor) -> Tensor:
    """norm(A + added) - norm(A) for `layer`'s attention-output norm, `attn` being (A, norm(A)) as a run
    recorded them, for added [..., n, pos, d] over A [n, pos, d]."""
    before, normed = attn
    return attn_norm(model, layer)(before + added) - normed


def received(
    model: HookedModel, graph: EdgeGraph, cut: Tensor, diff: Tensor, before: dict[int, tuple[Tensor, Tensor]]
) -> Tensor:
    """[k, n, pos, d]: what k receivers read beyond this run's residual stream when the edges cut[:, j]
    ([senders, k], 0/1) are patched, diff [senders, n, pos, d] being out(corrupt) - out(this run); both
    may hold only a prefix of the senders, those the receivers read. Under mib the cut heads of a layer
    go through its norm together, on this run's A (`before`, per layer: A and the norm's output)."""
    if graph.post_norm != "mib":
        return torch.einsum("sk,snpd->knpd", cut, diff)
    # receivers that cut the same edges read the same: each such mixture computed once
    columns, which = torch.unique(cut, dim=1, return_inverse=True)
    if columns.shape[1] < cut.shape[1]:
        return received(model, graph, columns, diff, before)[which]
    senders = graph.senders[: len(cut)]  # a prefix of the senders: those the receivers read
    others = torch.tensor([s.kind != "head" for s in senders], device=cut.device)
    # the input's and the MLPs' differences add: only their rows that some receiver cuts are read (memory-bound)
    rows = (others & cut.ne(0).any(1)).nonzero().flatten()
    out = torch.einsum("sk,snpd->knpd", cut[rows], diff[rows])
    for layer, attn in before.items():
        heads = graph.head_rows(layer)
        if not bool(cut[heads].any()):
            continue
        # receivers that cut the same heads of this layer read the same mixture: each one normed once
        patterns, which = torch.unique(cut[heads], dim=1, return_inverse=True)  # [heads, u], [k]
        mixed = torch.einsum("hu,hnpd->unpd", patterns, diff[heads])
        out += renormed(model, layer, attn, mixed)[which]
    return out
